"""How many of its layers a high-priority request keeps on device when KV runs short.

Pure policy (DESIGN.md contract 1), after LayerKV and the paper's batch conductor (DESIGN.md, "Batch
conductor"). The pressure is E = KV pages the high-priority requests need / device pages. Below the
threshold λ everything high-priority stays on device. At and above it, a request's completed pages
keep only a band of its layers on device and the rest is read from the host tier layer by layer as
the forward pass reaches it. Every further level halves the residency again and moves the threshold
halfway to 1 (λ ← 1 − (1 − λ)/2): with λ = 0.5, half the layers from E = 0.5, a quarter from 0.75,
an eighth from 0.875, never less than one layer.

A page kept at residency 1/n holds n requests' bands (layers split into n contiguous ranges), so
the device memory such a page costs each of them is 1/n of a page.
"""

from __future__ import annotations

from dataclasses import dataclass

UNBAND_MARGIN = 0.1  # of the threshold


@dataclass(frozen=True)
class LayerResidency:
    threshold: float = 0.5  # λ: the pressure at which residency first halves

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")

    def unband(self, pressure: float) -> bool:
        """Load banded pages back whole? Only a margin below the threshold, so that a pressure
        hovering at it does not copy contexts back and forth at every step."""
        return pressure < self.threshold * (1 - UNBAND_MARGIN)

    def bands(self, pressure: float, num_layers: int) -> int:
        """Into how many layer bands a request's completed pages split at this pressure: 1 keeps
        every layer on device; n keeps 1/n of them."""
        bands, level = 1, self.threshold
        while pressure >= level and bands * 2 <= num_layers:
            bands *= 2
            level = 1 - (1 - level) / 2
        return bands


def band_layers(band: int, bands: int, num_layers: int) -> range:
    """Layers of band `band` of `bands`: contiguous, together covering every layer once."""
    if not 0 <= band < bands <= num_layers:
        raise ValueError(f"band {band} of {bands} does not fit {num_layers} layers")
    return range(band * num_layers // bands, (band + 1) * num_layers // bands)
