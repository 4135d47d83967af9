"""The kernel library's owner (engine/runner/native_kernels.py): the stale-build policy it shares with the
compiled block pool, one probe per op before the op is used, and the notes the Settings page shows.

The library's paths are pointed at a temporary folder for the policy's cases; the probes' cache is
emptied around every test, so each test sees its own library and probes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from engine.native_guard import REBUILD, StaleBuildError, StaleNativeModuleError
from engine.runner import kernel_probes, native_kernels
from engine.runner.attention_kernels import Kernel, choose_kernels, merge_into, merge_partials
from engine.runner.decoder_forward import layer_steps
from engine.runner.kernel_probes import PROBES, ProbeCase
from engine.runner.layer_steps import FUSED_STEPS
from engine.runner.native_kernels import StaleKernelLibraryError, load_ops, probe
from engine.runner.packed_linear import linear_kernels, pack_weight

CPU = torch.device("cpu")
CASE = ProbeCase(torch.float32, 9, 3, 64)


@pytest.fixture(autouse=True)
def fresh_probes():
    """Every test loads and probes anew, and leaves no result of its own behind."""
    load_ops.cache_clear()
    probe.cache_clear()
    yield
    load_ops.cache_clear()
    probe.cache_clear()


@pytest.fixture
def csrc(tmp_path, monkeypatch) -> Path:
    """A temporary csrc/ with two sources, which the library's paths now point at (nothing built yet)."""
    folder = tmp_path / "csrc"
    folder.mkdir()
    sources = (folder / "a.cpp", folder / "b.cpp")
    for source in sources:
        source.write_text("// source")
    library = folder / native_kernels.LIBRARY.name
    monkeypatch.setattr(native_kernels, "SOURCES", sources)
    monkeypatch.setattr(native_kernels, "LIBRARY", library)
    monkeypatch.setattr(native_kernels, "MANIFEST", library.with_suffix(".sources"))
    return folder


def build(csrc: Path, manifest: str = "a.cpp\nb.cpp\n", contents: bytes = b"not a library") -> None:
    """Write a library and its manifest into `csrc`, both newer than the sources."""
    native_kernels.MANIFEST.write_text(manifest)
    native_kernels.LIBRARY.write_bytes(contents)
    later = max(source.stat().st_mtime for source in native_kernels.SOURCES) + 5
    os.utime(native_kernels.LIBRARY, (later, later))


def test_a_library_not_built_runs_torchs_ops_and_every_note_says_why(csrc):
    ops, why = load_ops()
    assert ops is None and why == f"{native_kernels.LIBRARY.name} not built (`make native` builds it)"
    choice = choose_kernels(CPU, torch.float32, 9, 3, 64)
    assert (choice.unmasked, choice.masked, choice.decodes, choice.notes) == (Kernel.CPU_FLASH, Kernel.CPU_FLASH, None, (why,))
    steps = layer_steps(CPU, CASE)
    assert (steps.fused, steps.name) == ((), f"torch ops ({why})")
    assert linear_kernels(CPU, torch.float32) == f"oneDNN (no panel kernel: panel_linear (float32) unavailable: {why})"
    assert pack_weight(torch.randn(64, 8)).panels is None


@pytest.mark.parametrize(
    "manifest, edited, why",
    [
        ("a.cpp\n", None, "built from other sources"),  # b.cpp added since the build
        ("a.cpp\nb.cpp\nc.cpp\n", None, "built from other sources"),  # c.cpp deleted since
        ("a.cpp\nb.cpp\n", "b.cpp", "older than its sources"),  # b.cpp edited after
    ],
)
def test_a_stale_library_raises_naming_the_rebuild_wherever_it_would_be_used(csrc, manifest, edited, why):
    build(csrc, manifest)
    if edited is not None:
        later = native_kernels.LIBRARY.stat().st_mtime + 5
        os.utime(csrc / edited, (later, later))
    for use in (load_ops, lambda: choose_kernels(CPU, torch.float32, 9, 3, 64), lambda: layer_steps(CPU, CASE),
                lambda: pack_weight(torch.randn(64, 8))):
        with pytest.raises(StaleKernelLibraryError, match=why) as raised:
            use()
        assert f"run `{REBUILD}` to rebuild, or delete " in str(raised.value)
        assert str(raised.value).endswith(f"{native_kernels.LIBRARY.name} to run torch's ops")


def test_a_library_the_loader_refuses_is_stale_too(csrc):
    build(csrc)  # current by its manifest and times, but not a library
    with pytest.raises(StaleKernelLibraryError, match="failed to load"):
        load_ops()


def test_a_stale_kernel_library_and_a_stale_compiled_module_follow_one_policy():
    errors = (StaleKernelLibraryError("x.so is older than its sources"), StaleNativeModuleError(["engine/core/block.py"]))
    for error in errors:
        assert isinstance(error, StaleBuildError) and isinstance(error, ImportError)
        assert f"run `{REBUILD}` to rebuild, or delete " in str(error)


def test_every_op_the_library_defines_has_a_probe():
    """An op without a probe could be handed out unchecked (pack_panels is checked by panel_linear's)."""
    defined = {
        name
        for source in native_kernels.SOURCES
        for name in re.findall(r'm\.def\(\s*"(\w+)\(', source.read_text())
    }
    assert defined == {*PROBES, "pack_panels"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(PROBES))
def test_each_ops_probe_runs_once_and_passes_on_the_built_library(monkeypatch, name, dtype):
    calls = []
    measure = PROBES[name]
    monkeypatch.setitem(PROBES, name, lambda ops, case: calls.append(case) or measure(ops, case))
    case = ProbeCase(dtype, 9, 3, 64)
    first, again = probe(name, case), probe(name, case)
    assert first.passed and first.note is None, first.note
    assert again is first and calls == [case]


def failing(monkeypatch, name: str, error: float = 1.0) -> str:
    """Make op `name`'s probe find `error`; returns the note its probe will give."""
    monkeypatch.setitem(PROBES, name, lambda ops, case: error)
    return f"{name} (float32) differs from its reference by {error:.3g}"


def test_a_decoder_op_that_fails_its_probe_alone_runs_as_torch_ops_with_a_note(monkeypatch):
    note = failing(monkeypatch, "rope_")
    steps = layer_steps(CPU, CASE)
    assert steps.fused == tuple(name for name in FUSED_STEPS if name != "rope_")
    assert steps.name == f"fused CPU ops for rms_norm, add_rms_norm_, silu_and_mul, torch ops for the rest ({note})"
    qk = torch.randn(3, 12, 64)
    angles = torch.rand(3, 32)
    cos, sin = torch.cos(torch.cat([angles, angles], -1)), torch.sin(torch.cat([angles, angles], -1))
    assert steps.rope(qk, cos, sin) is not qk  # torch's rope: a new tensor


def test_a_failing_attention_op_falls_back_and_its_note_reaches_the_settings_summary(monkeypatch):
    notes = [failing(monkeypatch, name) for name in ("tiled_attention", "paged_decode")]
    choice = choose_kernels(CPU, torch.float32, 9, 3, 64)
    assert (choice.unmasked, choice.decodes) == (Kernel.CPU_FLASH, None)
    assert choice.summary() == f"cpu-flash; masked calls cpu-flash; decodes cpu-flash (padded batch); {notes[0]}; {notes[1]}"
    assert [probe(name, CASE).note for name in ("tiled_attention", "paged_decode")] == notes  # the owner's notes


def test_a_merge_that_fails_its_probe_merges_with_torchs_ops(monkeypatch):
    note = failing(monkeypatch, "merge_partials_")
    assert note in choose_kernels(CPU, torch.float32, 9, 3, 64).notes
    out_a, out_b = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    lse_a, lse_b = torch.randn(2, 3), torch.randn(2, 3)
    want = merge_partials(out_a, lse_a, out_b, lse_b)
    merge_into(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out_a, want)


def test_panel_linears_that_fail_their_probe_run_on_onednn_with_a_note(monkeypatch):
    note = failing(monkeypatch, "panel_linear")
    assert pack_weight(torch.randn(64, 8)).panels is None
    assert linear_kernels(CPU, torch.float32) == f"oneDNN (no panel kernel: {note})"


def test_a_probe_that_raises_fails_with_the_ops_own_message(monkeypatch):
    def refuses(ops, case):
        raise RuntimeError("head dimension 24 is not a multiple of 16\nmore detail")

    monkeypatch.setitem(PROBES, "tiled_attention", refuses)
    assert probe("tiled_attention", CASE).note == "tiled_attention (float32) unavailable: head dimension 24 is not a multiple of 16"


def test_probe_errors_are_relative_to_the_references_magnitude():
    assert kernel_probes.relative_error(torch.tensor([10.0, 1.0]), torch.tensor([10.5, 1.0])) == pytest.approx(0.5 / 10.5)
    assert kernel_probes.relative_error(torch.tensor([0.1]), torch.tensor([0.2])) == pytest.approx(0.1)
