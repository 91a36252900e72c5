"""Counter-based dropout masks (mgnn.backend.counter_rng, kernels/rng.cu): Philox4x32-10 against
Random123's known answers, and one mask bit for bit on NumPy, Numba, the emulated RawKernel, the
fake CuPy (subprocess) and nvcc/NVRTC for sm_90; the mask's statistics and invariances."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mgnn.backend.cupy_raw as raw
from mgnn.backend import counter_rng as R
from mgnn.backend.host_emulation import EMULATION_GEOMETRY, EmulationLauncher

RNG_FILES = {"rng.cu": ("dropout_mask",)}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Random123's kat_vectors for philox4x32 R=10 (as in DEShawResearch/Random123-Boost,
# libs/random/test/test_philox.cpp): counter, key, output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
HALF = R.dropout_threshold(0.5)
# (seed, step, layer, sample0, batch, n_elements, threshold): high seed words, counters that
# wrap mod 2**32 and need all 32 bits as kernel ints, p = 0 and a drop-everything threshold.
CASES = [
    (0, 0, 0, 0, 10, 37, HALF),
    (1, 3, 7, 5, 4, 64, R.dropout_threshold(0.1)),
    (2**32 - 1, 2**31, 2**31 + 1, 2**31 - 2, 5, 19, R.dropout_threshold(0.9)),
    (2**32, 11, 2, 2**32 - 3, 7, 23, HALF),
    (2**63 + 12345, 2**32 + 4, 2**40, 2**33 + 9, 3, 40, R.dropout_threshold(0.25)),
    (2**64 - 1, 1, 1, 0, 6, 17, 0),
    (7, 2, 9, 100, 3, 11, 1 << 24),
]


@pytest.fixture(scope="module")
def emulated():
    """A RawBackend over the emulation of rng.cu alone, outputs poisoned."""
    bk = raw.RawBackend(EmulationLauncher(list(RNG_FILES), RNG_FILES), "cuda-emulated")
    bk.poison_outputs = True
    return bk


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    got = R.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert got.dtype == np.uint32 and got.tolist() == list(expected)


def test_philox_is_vectorised_over_leading_axes():
    counters = np.array([c for c, _, _ in KAT] * 2, np.uint32).reshape(2, 3, 4)
    got = R.philox4x32_10(counters, np.zeros(2, np.uint32))
    assert got.shape == (2, 3, 4)
    assert got[1, 0].tolist() == list(KAT[0][2])
    for c in counters.reshape(-1, 4):  # each row is its own block
        assert R.philox4x32_10(c, np.zeros(2, np.uint32)).tolist() in got.reshape(-1, 4).tolist()


def test_philox_rejects_bad_arrays():
    with pytest.raises(TypeError, match="counter"):
        R.philox4x32_10(np.zeros(4), np.zeros(2, np.uint32))
    with pytest.raises(ValueError, match="counter"):
        R.philox4x32_10(np.zeros(3, np.uint32), np.zeros(2, np.uint32))
    with pytest.raises(ValueError, match="key"):
        R.philox4x32_10(np.zeros(4, np.uint32), np.zeros(3, np.uint32))


def _mask_from_blocks(seed, step, layer, sample0, batch, n, threshold):
    """The mask's definition spelled out with the KAT-checked block function."""
    e, i = np.meshgrid(np.arange(n), np.arange(batch))
    c = np.stack([e, (sample0 + i) % 2**32, np.full_like(e, layer % 2**32),
                  np.full_like(e, step % 2**32)], axis=-1).astype(np.uint32)
    r = R.philox4x32_10(c, np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32))[..., 0]
    return ((r >> 8) >= threshold).astype(np.uint8)


@pytest.mark.parametrize("case", CASES)
def test_masks_agree_bit_for_bit(case, emulated):
    ref = _mask_from_blocks(*case)
    masks = {"numpy": R.dropout_mask(*case), "numba": R.dropout_mask_numba(*case),
             "emulated": R.launch_dropout_mask(emulated, *case)}
    for name, m in masks.items():
        assert m.dtype == np.uint8 and m.shape == case[4:6], name
        np.testing.assert_array_equal(m, ref, err_msg=name)
    if case[-1] == 0:
        assert (ref == 1).all()
    if case[-1] == 1 << 24:
        assert (ref == 0).all()


@pytest.mark.parametrize("geometry", ["capped", "gpu"])
def test_emulated_kernel_at_other_geometries(geometry):
    """MAX_GRID = 2 caps both grid axes (every thread loops over samples and elements); the GPU
    geometry runs 256-thread blocks over a ragged row."""
    geo = (dict(EMULATION_GEOMETRY, MAX_GRID=2) if geometry == "capped"
           else dict(raw.GPU_GEOMETRY, MAX_GRID=4))
    bk = raw.RawBackend(EmulationLauncher(list(RNG_FILES), RNG_FILES, geo), "cuda-emulated")
    bk.poison_outputs = True
    case = (2**40 + 3, 5, 6, 2**31 + 1, 3, 300, HALF) if geometry == "gpu" else \
        (2**40 + 3, 5, 6, 2**31 + 1, 9, 45, HALF)
    out = np.empty(case[4:6], np.uint8)
    assert R.launch_dropout_mask(bk, *case, out=out) is out
    np.testing.assert_array_equal(out, R.dropout_mask(*case))
    assert R.launch_dropout_mask(bk, 1, 1, 1, 0, 0, 5, HALF).shape == (0, 5)  # nothing launched


def test_any_grid_is_correct_and_poison_shows_a_missing_launch(emulated):
    """Grid-stride on both axes: a single block still writes everything; with no launch at all
    the poisoned output (2: neither keep nor drop) is left."""
    real, want = emulated.launcher.launch, R.dropout_mask(3, 1, 1, 0, 4, 40, HALF)
    try:
        emulated.launcher.launch = lambda name, dtype, grid, block, args: real(
            name, dtype, (1, 1, 1), block, args)
        np.testing.assert_array_equal(R.launch_dropout_mask(emulated, 3, 1, 1, 0, 4, 40, HALF),
                                      want)
        emulated.launcher.launch = lambda *a: None
        assert (R.launch_dropout_mask(emulated, 3, 1, 1, 0, 4, 40, HALF) == 2).all()
    finally:
        emulated.launcher.launch = real


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.77])
def test_keep_rate_is_one_minus_p(p):
    n = 100_000
    q = 1 - R.dropout_threshold(p) / 2**24
    rate = R.dropout_mask_numba(2**35 + 17, 4, 3, 0, 100, n // 100, R.dropout_threshold(p)).mean()
    assert abs(rate - q) <= 4 * np.sqrt(q * (1 - q) / n) + 1e-12, (p, rate)


@pytest.mark.parametrize("fn", [R.dropout_mask, R.dropout_mask_numba])
def test_split_over_processes_does_not_change_the_mask(fn, emulated):
    args = dict(seed=99, step=12, layer=3, n_elements=29, threshold=HALF)
    whole = fn(sample0=0, batch=10, **args)
    np.testing.assert_array_equal(whole[3:], fn(sample0=3, batch=7, **args))
    np.testing.assert_array_equal(whole[3:], R.launch_dropout_mask(emulated, sample0=3, batch=7,
                                                                   **args))


def test_step_layer_and_seed_change_the_mask():
    base = dict(seed=5, step=1, layer=2, sample0=0, batch=8, n_elements=64, threshold=HALF)
    ref = R.dropout_mask(**base)
    for change in (dict(step=2), dict(layer=3), dict(step=2, layer=1), dict(seed=6),
                   dict(seed=5 + 2**32), dict(sample0=1)):
        other = R.dropout_mask(**dict(base, **change))
        assert (other != ref).mean() > 0.3, change  # independent masks differ in ~half


def test_out_is_filled_in_place():
    out = np.full((4, 9), 7, np.uint8)
    assert R.dropout_mask_numba(3, 1, 1, 0, 4, 9, HALF, out=out) is out
    np.testing.assert_array_equal(out, R.dropout_mask(3, 1, 1, 0, 4, 9, HALF))
    assert R.dropout_mask(3, 1, 1, 0, 4, 9, HALF, out=np.empty((4, 9), np.uint8)).sum() == out.sum()
    for bad in (np.empty((4, 8), np.uint8), np.empty((4, 9), np.int8),
                np.empty((9, 4), np.uint8).T):
        with pytest.raises(ValueError, match="out"):
            R.dropout_mask_numba(3, 1, 1, 0, 4, 9, HALF, out=bad)


@pytest.mark.parametrize("p,exc", [(-0.1, ValueError), (1.0, ValueError),
                                   (float("nan"), ValueError), (float("inf"), ValueError),
                                   ("0.5", TypeError),
                                   (None, TypeError), (True, TypeError), (0.5j, TypeError)])
def test_bad_p_raises(p, exc):
    with pytest.raises(exc, match="dropout probability p"):
        R.dropout_threshold(p)


def test_thresholds():
    assert R.dropout_threshold(0) == 0 and R.dropout_threshold(np.float32(0.5)) == 2**23
    assert R.dropout_threshold(2.0**-24) == 1 and R.dropout_threshold(2.0**-25) == 1
    assert R.dropout_threshold(1 - 2.0**-53) == 2**24


@pytest.mark.parametrize("fn", [R.dropout_mask, R.dropout_mask_numba])
@pytest.mark.parametrize("name,value,exc", [
    ("seed", -1, ValueError), ("seed", 2**64, ValueError), ("seed", 1.0, TypeError),
    ("step", -2, ValueError), ("layer", 2.5, TypeError), ("sample0", -1, ValueError),
    ("batch", -1, ValueError), ("n_elements", None, TypeError),
    ("threshold", 2**24 + 1, ValueError), ("threshold", 0.5, TypeError),
    ("threshold", True, TypeError)])
def test_bad_arguments_raise_naming_them(fn, name, value, exc):
    args = dict(seed=1, step=1, layer=1, sample0=0, batch=2, n_elements=3, threshold=HALF)
    args[name] = value
    with pytest.raises(exc, match=name):
        fn(**args)


def test_launch_rejects_sizes_beyond_int(emulated):
    with pytest.raises(ValueError, match="n_elements"):
        R.launch_dropout_mask(emulated, 1, 1, 1, 0, 1, 2**31 - 1, HALF)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_nvcc_compiles_rng_with_every_kernel_for_sm_90(monkeypatch):
    """One translation unit with every kernel file (names must be unique), -Werror."""
    monkeypatch.setattr(raw.launch, "KERNEL_FILES", dict(raw.KERNEL_FILES, **RNG_FILES))
    assert raw.compile_with_nvcc("sm_90") == ""


def test_nvrtc_compiles_rng_as_cupy_will(monkeypatch):
    pytest.importorskip("cupy")
    monkeypatch.setattr(raw.launch, "KERNEL_FILES", RNG_FILES)
    assert raw.compile_with_nvrtc("90") == {"rng.cu": ""}


FAKE_CUPY_SCRIPT = """
import numpy as np, cupy
import mgnn.backend.cupy_raw as raw
from mgnn.backend import counter_rng as R
from mgnn.backend.host_emulation import EMULATION_GEOMETRY
raw.KERNEL_FILES = raw.launch.KERNEL_FILES = {"rng.cu": ("dropout_mask",)}
bk = raw.RawBackend(raw.CupyLauncher(EMULATION_GEOMETRY), "cuda")
args = (2**64 - 1, 2**32 + 1, 5, 2**31 + 7, 10, 21, R.dropout_threshold(0.5))
ref = R.dropout_mask(*args)
for m in (R.dropout_mask(*args, xp=cupy), R.launch_dropout_mask(bk, *args)):
    assert isinstance(m, cupy.ndarray) and m.dtype == np.uint8
    assert (m.get() == ref).all()
c = R.philox4x32_10(cupy.asarray(np.zeros((2, 4), np.uint32)), cupy.asarray(np.zeros(2, np.uint32)))
assert isinstance(c, cupy.ndarray)
assert c.get()[1].tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
print("fake-cupy-ok")
"""


def test_cupy_paths_on_the_fake_cupy():
    """xp=cupy uses only CuPy functions and the CupyLauncher path passes every 32-bit argument
    as int32 (CuPy refuses host arrays and out-of-range ints): tests/fakegpu in a subprocess."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests", "fakegpu"),
                                                       REPO]),
               NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", FAKE_CUPY_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "fake-cupy-ok" in proc.stdout, proc.stdout + proc.stderr
