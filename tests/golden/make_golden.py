"""Regenerate quickstart_losses.json (only after an intended change to the maths):
    python tests/golden/make_golden.py
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

here = Path(__file__).resolve().parent
with tempfile.TemporaryDirectory() as run_dir:
    subprocess.run([sys.executable, "-m", "toolkit", "run", "recipes/quickstart.json", "--run-dir", run_dir,
                    "training.log_interval=1", "logging.console=false"], check=True, cwd=here.parent.parent)
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
losses = {str(m["step"]): round(m["loss"], 6) for m in lines if "loss" in m}
out = {"command": "python -m toolkit run recipes/quickstart.json training.log_interval=1", "losses": losses}
(here / "quickstart_losses.json").write_text(json.dumps(out, indent=1) + "\n")
print(f"wrote {len(losses)} losses: {losses['1']} ... {losses[str(len(losses))]}")
