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


@pytest.mark.parametrize("kind", ["rnn", "dense"])
def test_study_refuses_a_non_gru_checkpoint(tmp_path, kind):
    study = _script()
    model = (mgnn.rnn_classifier(1, 3, 2, 8, dtype="float32") if kind == "rnn" else
             mgnn.dense_resnet(4, 4, 2, 4, dtype="float32"))
    ckpt = tmp_path / f"{kind}.npz"
    save_checkpoint(ckpt, model, Adam(model.params, lr=1e-3), 1, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match=f"holds a '{kind}' model; this study takes a GRU"):
        study.main(["--checkpoint", str(ckpt), "--cycles", "1"])


def test_markdown_columns_follow_the_header_whatever_the_cycle_order():
    study = _script()
    rows = [dict(weights="trained", serial_loss=1.0, coarse="implicit", cf=4, nrelax=[1],
                 levels=2, cycles=k, residual=float(k), loss=1.0, grad_err=0.5) for k in (4, 1)]
    header, _, line = study.markdown(rows).splitlines()
    assert header.index("1 cycles") < header.index("4 cycles")
    assert line.index("1.0e+00 /") < line.index("4.0e+00 /")
