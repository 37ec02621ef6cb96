"""Every kernel of the case table compiles with nvcc for sm_90a.

Kernels are compiled many per translation unit (the headers are parsed once per unit)
and the units in parallel, which keeps this at a few seconds per core.
"""

from __future__ import annotations

import re

import pytest
import torch

from stitch_backend import toolchain
from stitch_backend.codegen import generate

from .cases import BIG, CASES

PER_UNIT = 14


@pytest.mark.nvcc
@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_every_case_compiles_for_sm90a(compiler):
    """With both compilers: NVRTC is the default ("auto"), nvcc the fallback."""
    if compiler == "nvrtc":
        try:
            toolchain.load_nvrtc()
        except toolchain.ToolchainError as err:
            pytest.skip(f"libnvrtc does not load here: {str(err).splitlines()[0]}")
    kernels = [generate(c.trace(), c.name) for c in CASES + BIG]
    units = [kernels[i:i + PER_UNIT] for i in range(0, len(kernels), PER_UNIT)]
    jobs = [toolchain.CompileJob("\n".join(k.source for k in unit), f"codegen_unit{j}", "sm_90a",
                                 compiler=compiler)
            for j, unit in enumerate(units)]
    results = toolchain.compile_many(jobs, max_workers=2)
    for unit, res in zip(units, results):
        assert not isinstance(res, toolchain.CompileError), str(res)
        for k in unit:
            assert k.entry.encode() in res.cubin, f"{k.entry} missing from the cubin"


def test_layout_conversions_take_the_tiled_template_and_others_do_not():
    """Loads contiguous along one index, stores along another: 32x32 shared-memory tiles
    (256 threads, one tile per block and step); every other case keeps the plain loop."""
    for case in CASES + BIG:
        k = generate(case.trace(), case.name)
        tiled = k.emitted.layout == "tiled"
        assert tiled == case.name.startswith("pw_tiled_"), case.name
        if tiled:
            assert "__shared__" in k.source and "__syncthreads();" in k.source
            blocks, threads, _ = k.launch_shape(2 * 40 * 42, 0)
            assert (blocks, threads) == (4, 256)
            big = 64 * 128 * 254 * 254      # L2 4's conv output: a block per tile
            assert k.launch_shape(big, 0)[0] == -(-big // (32 * 32))


def test_reductions_over_several_indices_take_vector_chunks_along_the_innermost():
    """BatchNorm's statistics reduce N and H*W: 16-byte loads along H*W when its extent is
    a multiple of the width (the fp32 case), scalar chunks when it is not."""
    expect = {"big_batch_norm_train": 4, "red_sum_outer_inner_vec": 4,
              "red_var_outer_inner_odd": 1}
    for case in CASES + BIG:
        if case.name in expect:
            k = generate(case.trace(), case.name)
            assert k.emitted.vec == expect[case.name], case.name
            assert ("sfk_ldv<4>" in k.source) == (expect[case.name] == 4), case.name


def test_a_view_of_a_permuted_input_indexes_memory_linearly():
    """(N, C, H, W) stored channels-last, permuted to NHWC and reshaped to (N*H*W, C):
    the load is ``in0[c + 6 * p]`` (the view's own strides), not the row-major split of
    p into n, h, w with divisions and remainders."""
    case = next(c for c in CASES if c.name == "red_channels_last_columns")
    k = generate(case.trace(), case.name)
    loads = [line for line in k.source.splitlines() if "in0[" in line]
    assert loads and not any("%" in line or "/" in line for line in loads), loads


def test_a_channels_last_pooling_takes_its_rows_channel_fastest():
    """Rows (n, c, ho, wo) of a window reduction whose input is contiguous along c: the
    column layout with c the fastest row digit (the loops follow memory order), so
    neighbouring threads read neighbouring channels. Many such short rows fill blocks of
    at least 128 threads, not one warp."""
    for name in ("red_pool_channels_last", "red_pool_channels_last_mean"):
        case = next(c for c in CASES if c.name == name)
        k = generate(case.trace(), case.name)
        assert k.emitted.layout == "column", name
        first = next(ln.strip() for ln in k.source.splitlines() if "= r %" in ln)
        assert first.endswith("= r % 5;"), first          # C = 5
        blocks, threads, log2_tk = k.launch_shape(1 << 22, 4)
        assert threads >= 128 and log2_tk == 0, (blocks, threads, log2_tk)
        assert k.launch_shape(64, 4)[1] == 32           # few rows: blocks stay small


def test_channels_last_concatenations_read_along_the_channels():
    """A concatenation reads each input at a clamped channel (``min(31, c)``), whose
    stride is no plain number; where the input is read it is the unclamped index's. So a
    batch norm over a cat of channels-last inputs takes the column layout (threads on
    neighbouring channels; before: the inner layout, each thread a row, reading 48
    floats apart), and a cat of channels-last inputs into an NCHW output goes through
    the tiled template (the case table's ``pw_tiled_cat_from_channels_last``). With an
    NCHW input among channels-last ones (DenseNet's block input), most inputs decide
    (``..._mixed_layouts``; before, the NCHW input alone did)."""
    by_name = {c.name: c for c in CASES}
    for name in ("norm_cat_batch_norm_channels_last", "norm_cat_batch_norm_mixed_layouts"):
        k = generate(by_name[name].trace(), name)
        assert k.emitted.layout == "column", name
    k = generate(by_name["pw_tiled_cat_from_channels_last"].trace(), "cat_tiled")
    assert k.emitted.layout == "tiled"


def test_a_channels_last_pooling_over_overlapping_windows_takes_its_rows_channel_fastest():
    """A padded, strided max pooling (ResNet's stem) reads its input through clamped
    window indices, whose strides are no plain numbers: the rows then follow the
    output's memory order, channels fastest, so neighbouring threads read and write
    neighbouring channels (before: the logical order, one channel per thread 2*C
    elements apart). The NCHW case keeps the width fastest."""
    for name, inner in (("pool_max2d_stem_channels_last", "= r % 6;"),
                        ("pool_max2d_stem", "= r % 8;")):
        case = next(c for c in CASES if c.name == name)
        k = generate(case.trace(), case.name)
        first = next(ln.strip() for ln in k.source.splitlines() if "= r %" in ln)
        assert first.endswith(inner), (name, first)


def test_reduction_shared_memory_fits_its_widest_accumulator():
    """The inner layout stages one accumulator per warp (at most 32): 128 bytes for fp32
    sums, 512 where an argmax carries (value, index) pairs; the column layout one per
    thread (up to 1024), 4 KB for fp32."""
    want = {"red_sum_outer_inner_vec": 128, "red_argmax_argmin": 512,
            "red_pool_channels_last_mean": 4096}
    for case in CASES:
        if case.name in want:
            source = generate(case.trace(), case.name).source
            assert f"sfk_smem[{want[case.name]}]" in source, case.name


def test_rows_read_by_several_passes_are_read_once_into_registers():
    """Layer norm reads its row for the mean, the variance and the output: with a static
    row that 256 threads cover in 4 chunks each, the first pass keeps the loaded chunks
    in registers and the later ones read them there (the kernel bounded to 256 threads a
    block, and launched so). A softmax, whose passes call exp on each element, streams
    (faster so on the H200: emit_reduction's comment), as do a longer row and a single
    pass."""
    by_name = {c.name: c for c in CASES + BIG}
    k = generate(by_name["big_layer_norm_f16"].trace(), "big_layer_norm_f16")
    src = k.source
    assert "__launch_bounds__(256)" in src and k.emitted.max_threads == 256
    assert src.count("(c_vin0_0[j] = sfk_ldv<") == 1        # filled by the mean pass
    assert src.count("= c_vin0_0[j];") == 2                 # the variance and store passes
    assert "} else if (vec_row) {" in src                   # the streaming path stays
    blocks, threads, log2_tk = k.launch_shape(1024, 768)
    assert threads <= 256 and 768 // 8 <= 4 * (1 << log2_tk)

    for name in ("big_softmax", "big_softmax_long", "red_sum_last"):
        other = generate(by_name[name].trace(), name)
        assert "persist_row" not in other.source, name
        assert "__launch_bounds__(1024)" in other.source and other.emitted.max_threads == 1024


def _persistent_blocks(source: str) -> list[str]:
    """The persistent variant of each pass over a row (emit_reduction._k_loops)."""
    return [part.split("} else if (vec_row) {")[0] for part in source.split("if (persist_row) {")[1:]]


def test_cache_values_keeps_each_pass_computed_values_in_registers():
    """``cache_values``: a softmax's persistent row reads its input once (the maximum's
    pass keeps it), computes each exp once (the sum's pass keeps exp(x - max)) and its
    store pass reads nothing but registers; the template kernel stays as it was
    (streaming, no register arrays). A layer norm keeps x, then x - mean."""
    by_name = {c.name: c for c in CASES + BIG}
    gm = by_name["big_softmax"].trace()
    plain = generate(gm, "sm")
    assert "persist_row" not in plain.source and plain.emitted.cached_values == 0
    k = generate(gm, "sm_pv", cache_values=True)
    assert k.emitted.cached_values == 2 and k.emitted.max_threads == 256
    first, second, store = _persistent_blocks(k.source)
    assert "sfk_ldv<" in first and "cv0[j * 4 + v] = " in first and "expf" not in first
    assert "sfk_ldv<" not in second and second.count("expf(") == 1
    assert "cv0[j * 4 + v]" in second and "cv1[j * 4 + v] = " in second
    assert "sfk_ldv<" not in store and "expf" not in store and "cv1[j * 4 + v]" in store
    assert "sfk_stv<4>(out0" in store
    # the streaming variants (unaligned rows) still compute everything
    assert k.source.count("expf(") == 1 + 2 * 2

    ln = generate(by_name["big_layer_norm_f16"].trace(), "ln_pv", cache_values=True)
    assert ln.emitted.cached_values == 2
    mean, var, out = _persistent_blocks(ln.source)
    assert "sfk_ldv<" in mean and "sfk_ldv<" not in var
    assert ln.emitted.vec == 8       # fp16: 16-byte vectors of 8
    assert "cv1[j * 8 + v] = " in var and "cv1[j * 8 + v]" in out and "cv0" not in out
    # a single pass has nothing to keep; a row too long for the registers streams
    for name in ("red_sum_last", "big_softmax_long"):
        other = generate(by_name[name].trace(), name, cache_values=True)
        assert other.emitted.cached_values == 0 and "persist_row" not in other.source, name


@pytest.mark.nvcc
def test_cache_values_kernels_compile_for_sm90a():
    """Every case whose reduction keeps values between passes, generated so, compiles."""
    kernels = [k for k in (generate(c.trace(), c.name + "_pv", cache_values=True)
                           for c in CASES + BIG if c.trace is not None)
               if k.emitted.cached_values]
    assert len(kernels) >= 5
    jobs = [toolchain.CompileJob("\n".join(k.source for k in kernels[i:i + PER_UNIT]),
                                 f"pv_unit{i}", "sm_90a") for i in range(0, len(kernels), PER_UNIT)]
    for res in toolchain.compile_many(jobs, max_workers=2):
        assert not isinstance(res, toolchain.CompileError), str(res)


def test_long_rows_take_eight_chunks_a_thread():
    """Rows that would take more than 512 threads at 4 vector chunks each take 8 a thread
    (fused.launch_shape's comment: L2 17's instance norm rows, timed on an H100)."""
    by_name = {c.name: c for c in CASES + BIG}
    k = generate(by_name["big_softmax"].trace(), "big_softmax")
    assert k.emitted.layout == "inner" and k.emitted.vec == 4
    tk = {n: 1 << k.launch_shape(128, n)[2] for n in (4096, 8192, 12000, 126 * 126, 32768)}
    assert tk == {4096: 256, 8192: 512, 12000: 512, 126 * 126: 512, 32768: 1024}
    assert k.launch_shape(128, 126 * 126)[1] == 512               # one row a block


def test_inner_row_reductions_launch_a_block_per_group_of_rows():
    """No grid-stride cap at the resident threads for rows reduced along their innermost
    index (faster so on the H200: fused.launch_shape's comment); above MAX_ROW_BLOCKS
    blocks, blocks loop over rows."""
    from stitch_backend.codegen.fused import MAX_ROW_BLOCKS

    by_name = {c.name: c for c in CASES + BIG}
    k = generate(by_name["big_softmax"].trace(), "big_softmax")
    assert k.emitted.layout == "inner"
    blocks, threads, log2_tk = k.launch_shape(524288, 512)
    rows_a_block = threads >> log2_tk
    assert blocks * rows_a_block == 524288
    assert k.launch_shape(1 << 40, 512)[0] == MAX_ROW_BLOCKS


def test_only_long_softmax_rows_take_both_statistics_in_one_pass():
    """Rows of ONLINE_SOFTMAX_MIN or more take (max, sum of exp) in one reduction and read
    the row twice; shorter rows, whose second read comes from the L2, and symbolic
    lengths keep the maximum, then the sum."""
    by_name = {c.name: c for c in CASES + BIG}
    for name, one_pass in (("norm_softmax_one_pass", True), ("norm_log_softmax_one_pass", True),
                           ("big_softmax_one_pass", True), ("big_softmax_long", False),
                           ("norm_softmax", False), ("dyn_softmax", False)):
        k = generate(by_name[name].trace(), name)
        kinds = [r.kind for r in k.ir.reductions]
        assert ("sfk_online_add" in k.source) == one_pass, name
        assert kinds == (["softmax"] if one_pass else ["max", "sum"]), (name, kinds)


def test_indices_are_32_bit_unless_a_count_or_a_span_needs_64():
    """Rows and reduced elements are indexed apart, so their product may pass 2^31 (L1
    41's max pooling: 805M rows of an 8-wide window) with 32-bit indices; a tensor whose
    elements reach past 2^31 still gets 64-bit ones."""
    import torch
    import torch.nn.functional as F
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    def kernel(fn, shape):
        gm = make_fx(fn, decomposition_table=core_aten_decompositions(),
                     tracing_mode="fake")(torch.empty(shape, device="meta"))
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return generate(gm, "idx")

    pool = kernel(lambda a: F.max_pool1d(a, 8, 1, 4, 3), (64, 192, 65536))
    assert not pool.emitted.idx64 and "long long" not in pool.source
    wide = kernel(lambda a: torch.softmax(a, -1), (1 << 20, 4096))    # 2^32 elements
    assert wide.emitted.idx64
    many_rows = kernel(lambda a: a.sum(-1), (1 << 31, 2))              # 2^31 rows
    assert many_rows.emitted.idx64
    # a reduction's row loop steps by up to ROW_STEP_MAX rows: 1.5e9 rows need 64 bits
    from stitch_backend.codegen.emit_cuda import ROW_STEP_MAX
    from stitch_backend.codegen.fused import MAX_ROW_BLOCKS, MAX_THREADS
    assert MAX_ROW_BLOCKS * MAX_THREADS <= ROW_STEP_MAX
    # rows of a broadcast input: its span is 0, the output's under 2^31
    assert kernel(lambda a: a.expand(3 << 29, 2).sum(-1), (1,)).emitted.idx64
    assert not kernel(lambda a: a.expand(1 << 29, 2).sum(-1), (1,)).emitted.idx64


def test_pointwise_kernels_launch_a_thread_per_vector():
    """A streaming pointwise kernel launches one thread per vector (faster so on the H200:
    fused.launch_shape's comment), except that with 32-bit indices the grid's step plus
    the element count stays below 2^31 (the loop then takes more than one step)."""
    from stitch_backend.codegen.fused import INT32_MAX

    by_name = {c.name: c for c in CASES + BIG}
    k = generate(by_name["big_bias_gelu"].trace(), "big_bias_gelu")
    assert k.emitted.kind == "pointwise" and k.emitted.vec == 4 and not k.emitted.idx64
    n = 4096 * 196608
    blocks, threads, _ = k.launch_shape(n, 0)
    assert threads == 256 and blocks * threads * 4 == n
    near = 2 ** 31 - 2 ** 24          # the most elements 32-bit indices are used for
    blocks, threads, _ = k.launch_shape(near, 0)
    assert near + blocks * threads * 4 <= INT32_MAX
    assert blocks * threads * 4 < near          # a grid-stride loop: several steps
    assert k.launch_shape(1000, 0)[0] == 1


def test_short_window_rows_take_one_thread_each_in_an_unrolled_loop():
    """A pooling's window (a constant count of at most SERIAL_MAX_K elements, read without
    the vector path) is reduced by one thread a row in a fully unrolled loop, so the
    window offsets are constants (emit_reduction's comment: L1 42 on the H200), and the
    launch gives every thread its own row; long rows keep their thread groups."""
    from stitch_backend.codegen.emit_reduction import SERIAL_MAX_K
    from stitch_backend.codegen.fused import SERIAL_THREADS

    by_name = {c.name: c for c in CASES + BIG}
    for name, window in (("pool_max2d_pad", 16), ("pool_max3d", 27), ("pool_max1d_dilated", 8)):
        k = generate(by_name[name].trace(), name)
        assert k.emitted.serial and window <= SERIAL_MAX_K, name
        assert f"for (int k0 = 0; k0 < {window}; ++k0)" in k.source, name
        assert "sfk_group_reduce" not in k.source, name
        rows = 3 * SERIAL_THREADS + 5
        assert k.launch_shape(rows, window) == (4, SERIAL_THREADS, 0), name
    for name in ("big_softmax", "red_sum_last"):
        k = generate(by_name[name].trace(), name)
        assert not k.emitted.serial and "sfk_group_reduce" in k.source, name


def _enclosing(lines: list[str], i: int) -> str:
    """The nearest line above ``lines[i]`` that is indented less (its block's opening)."""
    depth = len(lines[i]) - len(lines[i].lstrip())
    for line in reversed(lines[:i]):
        if line.strip() and len(line) - len(line.lstrip()) < depth:
            return line.strip()
    return ""


def test_a_concatenation_loads_only_the_input_each_element_comes_from():
    """A cat is a chain of wheres on the position. Where the condition is the same for a
    vector chunk's lanes (a cat along channels), the chunk loads the picked input's
    vector alone (if / else if on the position); in scalar code each input is loaded
    inside its own branch. Before, every input was loaded for every element."""
    by_name = {c.name: c for c in CASES + BIG}
    vec = generate(by_name["cat_channels_vec"].trace(), "cat_channels_vec").source
    loads = [line.strip() for line in vec.splitlines() if "sfk_ldv<4>(in" in line]
    assert len(loads) == 3, loads
    assert loads[0].startswith("if (") and loads[1].startswith("else if (")
    assert loads[2].startswith("else ") and all("vpick" in line for line in loads)
    stats = generate(by_name["cat_channels_then_stats"].trace(), "cat_channels_then_stats")
    assert stats.emitted.vec == 4 and "vpick" in stats.source
    for name in ("cat_rows", "cat_then_sum", "pad_constant"):   # scalar loads
        lines = generate(by_name[name].trace(), name).source.splitlines()
        at = [i for i, line in enumerate(lines) if "sfk_val(in" in line]
        assert at, name
        for i in at:
            assert re.fullmatch(r"(\} else )?(if \(.*\)|else) \{|\} else \{", _enclosing(lines, i)), (
                name, lines[i], _enclosing(lines, i))


def test_a_where_on_loaded_values_selects_without_branching():
    """A condition that reads memory (ReLU's backward, a mask) would make lanes diverge on
    data: both sides are evaluated and one selected, as before."""
    from .cases import T, f32, _c

    case = _c("where_on_data", lambda a, b, c: torch.where(a > 0, b, c) + 1,
              T((5, 7), f32), T((5, 7), f32), T((5, 7), f32))
    src = generate(case.trace(), case.name).source
    assert " ? " in src and "else" not in src
