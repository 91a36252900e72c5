"""scripts/recurrent_trained_convergence.py: MGRIT over time on a GRU checkpoint against the
serial solve (a small checkpoint written here; the study at two cycle counts)."""
import importlib.util
import json
import pathlib

import numpy as np
import pytest

import mgnn
from mgnn.optim import Adam
from mgnn.train import save_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "recurrent_trained_convergence", ROOT / "scripts" / "recurrent_trained_convergence.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_of_a_checkpoint_converges_at_initial_weights(tmp_path, capsys):
    study = _script()
    model = mgnn.gru_classifier(1, 6, 4, 32, dtype="float32", seed=3)
    ckpt = tmp_path / "gru.npz"
    save_checkpoint(ckpt, model, Adam(model.params, lr=1e-3), 1, 1,
                    np.random.default_rng(0), meta={"seed": 0})
    out = tmp_path / "rows.json"
    assert study.main(["--checkpoint", str(ckpt), "--samples", "5", "--cycles", "1,6",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["weights"] for r in rows} == {"trained", "initial"} and len(rows) == 2 * 7 * 2
    for r in rows:  # PyTorch-initialised GRUs contract: 6 cycles are far closer than 1
        assert r["cf"] in (2, 4, 8) and np.isfinite(r["grad_err"])
    by = {(r["weights"], r["coarse"], r["cf"], tuple(r["nrelax"]), r["levels"], r["cycles"]): r
          for r in rows}
    for (w, c, cf, nr, lv, k), r in by.items():
        if k == 6:
            first = by[(w, c, cf, nr, lv, 1)]
            assert r["grad_err"] < 0.1 * first["grad_err"] and r["residual"] < first["residual"]
            assert r["loss"] == pytest.approx(r["serial_loss"], rel=1e-3)
    table = capsys.readouterr().out
    assert table.count("\n| trained") == 7 and "| 1 cycles: res / loss / grad err |" in table


def test_study_refuses_a_non_gru_checkpoint(tmp_path):
    study = _script()
    model = mgnn.rnn_classifier(1, 3, 2, 8, dtype="float32")
    ckpt = tmp_path / "rnn.npz"
    save_checkpoint(ckpt, model, Adam(model.params, lr=1e-3), 1, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="holds a 'rnn' model; this study takes a GRU"):
        study.main(["--checkpoint", str(ckpt), "--cycles", "1"])
