"""Diagnostic: does `branch` at pointer_chain N=8 (seed 1) still collapse at a 10x lower learning rate?"""
import json, sys, time, importlib.util, pathlib
from longhorizon.studies import horizon
REPO = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("hs", REPO / "configs" / "horizon_sweep.py")
hs = importlib.util.module_from_spec(spec); spec.loader.exec_module(hs)
out = []
for label, lr_scale in (("branch", 1.0), ("branch", 0.1), ("vine", 0.1)):
    study = hs.get_config("credit_study")
    study.unlock(); study.num_updates = 12; study.optim.learning_rate *= lr_scale; study.lock()
    t = time.time()
    rows, curves = horizon.run_cell(study, horizon.Cell("pointer_chain", 8, 1), [label])
    r = rows[0]
    out.append({"algorithm": label, "lr": study.optim.learning_rate, "warm": r["warm_success"],
                "final": r["final_success"], "curve": [c["train_success"] for c in curves],
                "seconds": time.time() - t})
    print(json.dumps(out[-1]), flush=True)
json.dump(out, open("/work/runs/branch_diag.json", "w"), indent=1)
