"""Models for the gradient-guard tests and scripts/guard_study.py: a GRU whose hidden dynamics
are a weakly damped oscillator (the kind a trained long-sequence GRU has), where MGRIT with a
few cycles gives a gradient error of order 1 (issue 35)."""
import numpy as np


def oscillator_gru(seq_len=256, hidden=8, omega=4.0, z_gate=0.9, coarse="implicit",
                   dtype="float64", seed=0):
    """A GRU classifier (1 input feature, 4 classes) with r = 1, z = ``z_gate`` and a skew
    candidate weight: near h = 0 the step is h' = z h + (1 - z) omega S h, a rotation by about
    ``atan((1 - z) omega / z)`` per step (0.42 rad) damped by |lambda| ~ 0.985."""
    from mgnn import gru_classifier
    m = gru_classifier(1, hidden, 4, seq_len, coarse=coarse, dtype=dtype, seed=seed)
    p = m.params
    whh = p["gru.weight_hh_l0"]
    whh[...] = 0
    for i in range(0, hidden - 1, 2):  # 2 x 2 rotation generators, frequencies spread 10 % apart
        w = omega * (1 + 0.05 * i)
        whh[2 * hidden + i, i + 1], whh[2 * hidden + i + 1, i] = w, -w
    p["gru.bias_hh_l0"][...] = 0
    bih = p["gru.bias_ih_l0"]
    bih[...] = 0
    bih[:hidden] = 6.0                                  # reset gate r ~ 1
    bih[hidden:2 * hidden] = np.log(z_gate / (1 - z_gate))  # update gate z ~ z_gate
    return m


def sequences(batch, seq_len, seed=0):
    """(x (B, L, 1) float64 standard normal, y (B,) labels in [0, 4))."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, seq_len, 1)), rng.integers(0, 4, batch)
