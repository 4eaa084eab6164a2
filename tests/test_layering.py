"""The maths layer is closed: what ``import rlcore`` and ``import rlcore.algos`` load, and no private names across modules."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from rlcore import algos

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "rlcore"


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    # The environment is passed through: PYTHONPATH selects the rlcore under test.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), check=True)
    return json.loads(out.stdout)


def test_import_algos_loads_only_the_maths():
    loaded = _loaded_after("import rlcore.algos")
    higher = [
        m for m in loaded if m.split(".")[:2] in (["rlcore", p] for p in ("dataflow", "models", "memory", "train"))
    ]
    assert not higher, f"import rlcore.algos loaded {higher}"
    assert "rlcore.ops" in loaded


def test_import_rlcore_is_light():
    loaded = set(_loaded_after("import rlcore"))
    heavy = {"ray", "transformers", "hypothesis", "matplotlib"} & {m.split(".")[0] for m in loaded}
    assert not heavy, f"import rlcore loaded {sorted(heavy)}"


@pytest.mark.parametrize(
    "layer", ["ops", "algos", "models", "dataflow", "memory", "rewards", "data", "agent", "train", "testing"]
)
def test_no_private_name_is_imported_across_modules(layer):
    offenders = []
    for path in sorted((SRC / layer).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlcore"):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not offenders, offenders


def test_kl_coef_takes_an_adaptive_controller_by_composition():
    ctrl = algos.adaptive_kl_controller(init_kl_coef=0.1, target=0.01, horizon=10)
    state = ctrl.init()
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 3, dtype=torch.bool)
    logp = torch.randn(4, 3, generator=g) - 2.0
    batch = {
        "logp": logp.clone().requires_grad_(True),
        "old_logp": logp,
        "ref_logp": logp + 0.3,
        "advantages": torch.randn(4, 3, generator=g),
        "mask": mask,
    }
    fixed = algos.grpo(kl_coef=0.1)
    controlled = fixed._replace(kl_coef=ctrl)
    with pytest.raises(ValueError, match="'kl_coef' entry"):
        controlled.loss(batch)
    want, _ = fixed.loss(batch)
    got, metrics = controlled.loss({**batch, "kl_coef": state.kl_coef.expand(4)})
    torch.testing.assert_close(got, want)
    state = ctrl.update(metrics["kl"], state, n_steps=4)
    assert state.kl_coef.item() > 0.1  # the KL is above the target: beta grows
    # Micro-batch slicing keeps the per-sample coefficient.
    half = {k: v[:2] for k, v in {**batch, "kl_coef": state.kl_coef.expand(4)}.items()}
    assert torch.isfinite(controlled.loss(half)[0])
