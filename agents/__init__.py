"""The Planner, Coder and Verifier agents (installed as ``stitch_backend.agents``)."""
