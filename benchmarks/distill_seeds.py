"""The reverse-KL curve of tests/test_distill.py's learning test (tiny_distill.yaml's settings from the tests' SFT
teacher, on the CPU) over several seeds: one JSON line a seed with the curve, the held-out accuracy before and
after, and the last-3 / first-3 ratio the test asserts (means), with medians and 5-step means beside it.

    STEPS=16 PYTHONPATH=. python benchmarks/distill_seeds.py 0 1 2 3 4 5 6 7
"""
import json, os, statistics, sys, tempfile
os.environ["ACCELERATE_USE_CPU"] = "true"
sys.path.insert(0, "tests")
import unirl
from test_distill import sft_teacher

STEPS = int(os.environ.get("STEPS", "10"))
teacher = sft_teacher()
for seed in [int(s) for s in sys.argv[1:]]:
    with tempfile.TemporaryDirectory() as tmp:
        result = unirl.train("text", "tiny", {
            "distill.teacher": str(teacher), "rollout.engine": "hf", "trainer.total_steps": STEPS,
            "trainer.eval_every": STEPS, "trainer.save_every": 0, "trainer.progress": False, "data.eval_size": 50,
            "optim.lr": 1e-3, "trainer.ppo_epochs": 4, "trainer.seed": seed}, output_dir=tmp + "/run")
    kl = [m["distill/reverse_kl"] for m in result.metrics]
    acc = [e["eval/accuracy"] for e in result.evals]
    print(json.dumps({"seed": seed, "kl": [round(k, 3) for k in kl], "acc": acc,
                      "mean_ratio": round(statistics.mean(kl[-3:]) / statistics.mean(kl[:3]), 3),
                      "median_ratio": round(statistics.median(kl[-3:]) / statistics.median(kl[:3]), 3),
                      "mean5_ratio": round(statistics.mean(kl[-5:]) / statistics.mean(kl[:5]), 3)}), flush=True)
