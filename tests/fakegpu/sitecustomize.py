"""With FAKE_CUPY_SMALL_TILES=1 (tests only), mgnn's GPU launch geometry is shrunk to the host
emulation's tiny tiles at interpreter start, so whole training runs on the fake cupy stay fast."""
import os

if os.environ.get("FAKE_CUPY_SMALL_TILES") == "1":
    from mgnn.backend import cupy_raw
    from mgnn.backend.host_emulation import EMULATION_GEOMETRY

    cupy_raw.GPU_GEOMETRY.update(EMULATION_GEOMETRY)
