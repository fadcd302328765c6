"""The platform seam: a device is one ``Platform``, and everything that differs by
device asks it. A toy device added here, in the test, changes what the engine
config, the precision and the quantisation choices, and the worker environment say,
with no other code touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.engine import platform as platforms
from sluice.engine.config import EngineConfig
from sluice.engine.errors import ModelLoadError
from sluice.engine.platform import CPU, CUDA, Platform, platform
from sluice.engine.precision import choose_precision
from sluice.engine.quantization import NONE, check_quantization, choose_quantization


class ToyAccelerator(Platform):
    def device_count(self) -> int:
        return 4


TOY = ToyAccelerator(
    "toy",
    auto_dtype="float16",
    captures_graphs=True,
    packed_quantization=False,
    visible_devices="TOY_VISIBLE_DEVICES",
)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Platform:
    monkeypatch.setitem(platforms.PLATFORMS, "toy", TOY)
    return TOY


def no_shapes() -> tuple[tuple[int, int, int], ...]:
    raise AssertionError("a device with a fixed auto dtype measures nothing")


def test_a_new_device_is_one_platform(toy: Platform) -> None:
    assert platform("toy") is toy
    config = EngineConfig(device="toy")
    assert config.scheduler(context_length=64).fixed_shape_decode
    assert not EngineConfig(device="toy", cuda_graph=False).scheduler(64).fixed_shape_decode
    choice = choose_precision("auto", "toy", no_shapes)
    assert (choice.dtype, choice.reason) == ("float16", "toy")
    gguf = choose_quantization(None, Path("m.gguf"), frozenset({"Q4_1"}), "toy")
    assert gguf.method == NONE and "not toy" in gguf.reason
    with pytest.raises(ModelLoadError, match="runs on the CPU"):
        check_quantization("gguf", "toy")
    env = toy.worker_environment(2, 3, {"PATH": "/bin", "TOY_VISIBLE_DEVICES": "5,6,7"})
    assert env == {"PATH": "/bin", "TOY_VISIBLE_DEVICES": "7"}


def test_the_built_in_platforms() -> None:
    assert not EngineConfig(device="cpu").scheduler(64).fixed_shape_decode
    assert CPU.worker_environment(1, 2, {"PATH": "/bin"}) is None
    assert CUDA.worker_environment(1, 2, {}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert choose_precision("auto", "cuda", no_shapes).dtype == "bfloat16"
    assert choose_quantization(None, Path("m.gguf"), frozenset({"Q4_1"}), "cpu").method == "gguf"


def test_torch_compile_is_the_cpus_fixed_shape_step(toy: Platform) -> None:
    """``--enable-torch-compile`` turns the CPU's fixed-shape decode on, compiled, up to
    its own batch limit; a device whose steps are captured as graphs refuses it."""
    compiled = EngineConfig(device="cpu", torch_compile=True, torch_compile_max_bs=4)
    scheduler = compiled.scheduler(64)
    assert scheduler.fixed_shape_decode and scheduler.compile_decode
    assert scheduler.graph_max_batch == 4
    assert compiled.settings()["enable_torch_compile"] is True
    assert not EngineConfig(device="cpu").scheduler(64).compile_decode
    with pytest.raises(ModelLoadError, match="--enable-torch-compile compiles the CPU's"):
        EngineConfig(device="toy", torch_compile=True)
    with pytest.raises(ModelLoadError, match="--torch-compile-max-bs must be at least 1"):
        EngineConfig(torch_compile_max_bs=0)


def test_an_unknown_device_is_a_start_up_error() -> None:
    with pytest.raises(ModelLoadError, match="--device tpu: Sluice runs on cpu, cuda"):
        EngineConfig(device="tpu")
