"""Where the engine runs: the one module that knows the devices (``cpu``, ``cuda``).

What differs by device is asked of its ``Platform``, never decided by comparing
device names elsewhere: whether it is there and how many there are, ``--dtype
auto``'s choice on it, whether decode steps are captured as device graphs
(``cuda_graphs``), the variable that gives each ``--dp-size`` worker its own device,
and whether the packed quantisation kernels run on it. A new device is one more
``Platform`` in ``PLATFORMS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import ModelLoadError


@dataclass(frozen=True)
class Platform:
    name: str
    # ``--dtype auto`` on this device without measuring; None: measured (``precision``).
    auto_dtype: str | None
    # Fixed-shape decode steps are replayed from captured graphs (else run eagerly).
    captures_graphs: bool
    # The packed GEMMs of ``--quantization gguf`` / ``w8a8_int8`` run here.
    packed_quantization: bool
    # The environment variable that limits a process to some of the devices.
    visible_devices: str | None = None

    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def worker_environment(
        self, rank: int, workers: int, environ: Mapping[str, str]
    ) -> dict[str, str] | None:
        """Engine worker ``rank``'s environment: one device of its own where the
        platform has several (None: inherit this process's)."""
        if self.visible_devices is None:
            return None
        visible = environ.get(self.visible_devices)
        devices = visible.split(",") if visible else [str(i) for i in range(workers)]
        return {**environ, self.visible_devices: devices[rank]}


class _Cuda(Platform):
    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()


CPU = Platform("cpu", auto_dtype=None, captures_graphs=False, packed_quantization=True)
CUDA = _Cuda(
    "cuda",
    auto_dtype="bfloat16",
    captures_graphs=True,
    packed_quantization=False,
    visible_devices="CUDA_VISIBLE_DEVICES",
)
PLATFORMS: dict[str, Platform] = {p.name: p for p in (CPU, CUDA)}


def platform(device: str) -> Platform:
    """The platform of ``--device``; ``ModelLoadError`` for one Sluice does not run on."""
    try:
        return PLATFORMS[device]
    except KeyError:
        raise ModelLoadError(
            f"--device {device}: Sluice runs on {', '.join(sorted(PLATFORMS))}"
        ) from None
