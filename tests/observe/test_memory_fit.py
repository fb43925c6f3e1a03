"""A recipe too big for the machine: refused before anything is allocated, in one line
naming the keys that size it, the estimate, the limit and the ways out (exit 2);
`training.memory_check=warn` tries anyway, and an allocator failure that still comes is
one line too. The shipped recipes are not refused where they are meant to run.
"""
import pytest

from tests.conftest import run_cli
from toolkit.errors import UserError
from toolkit.observe.estimate import GiB
from toolkit.observe.memory_fit import allocation_failure, is_allocation_failure, size_terms
from toolkit.recipe.load import load_recipe

H200_FREE = 139 * GiB  # what torch.cuda.mem_get_info reports free on an idle H200 (about 139 GiB)


def _refusal(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: recipe: too big for this machine: needs about "), lines
    assert " is available: " in lines[0] and "ways out: " in lines[0] and "training.memory_check=warn" in lines[0]
    return lines[0]


def test_run_refuses_a_sequence_too_long_for_the_host_before_loading_torch(no_torch, tmp_path):
    run_dir = tmp_path / "run"
    # NOTE: no checkpoint: the position table of 1e8 rows makes one of ~77 GB, which a small disk refuses too
    line = _refusal(run_cli("run", "quickstart", "data.seq_len=100000000", "training.device=cpu",
                            "checkpoint.save_final=false", "--run-dir", str(run_dir), timeout=60))
    assert "activations" in line and "batch.micro_batch_per_rank 16 x data.seq_len 100000000" in line
    assert "a smaller batch.micro_batch_per_rank" in line and "model.activation_checkpointing=true" in line
    assert not run_dir.exists()


def test_run_refuses_a_width_too_large_for_the_host_before_loading_torch(no_torch, tmp_path):
    run_dir = tmp_path / "run"
    # NOTE: no checkpoint, whose 1.2 TB the pre-flight would refuse too (tests/train/test_preflight.py)
    line = _refusal(run_cli("run", "quickstart", "model.n_embd=65536", "training.device=cpu",
                            "checkpoint.save_final=false", "--run-dir", str(run_dir), timeout=60))
    assert "model states" in line and "model.n_embd 65536" in line and "a higher zero.stage" in line
    assert not run_dir.exists()


def test_memory_check_warn_tries_anyway_and_the_allocator_failure_is_one_line(tmp_path):
    # NOTE: a 48 GiB matrix: more than this machine's RAM, so the kernel refuses it at once.
    proc = run_cli("run", "quickstart", "model.n_embd=65536", "training.memory_check=warn", "training.device=cpu",
                   "checkpoint.save_final=false", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    warning, error = proc.stderr.splitlines()
    assert warning.startswith("warning: recipe: too big for this machine") and "trying anyway" in warning
    assert error.startswith("error: recipe: ran out of memory allocating 48.0 GiB") and "model.n_embd 65536" in error


def test_a_cuda_out_of_memory_message_becomes_one_line():
    exc = RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79 GiB")
    assert is_allocation_failure(exc) and not is_allocation_failure(RuntimeError("shape mismatch"))
    line = allocation_failure(load_recipe("quickstart"), exc)
    assert isinstance(line, UserError) and len(line.lines) == 1
    assert line.lines[0].startswith("recipe: ran out of memory allocating 20.00 MiB (RuntimeError)")
    assert "data.vocab_size 256," in line.lines[0]  # every size named by its recipe key, the vocabulary too


@pytest.mark.parametrize("name, world_size", [("gpt2-124m", 1), ("llama-1b", 1), ("gpt2-medium-zero2", 8),
                                              ("gpt2-1.5b-zero3", 8), ("gpt2-1.5b-zero3", 1)])
def test_gpu_recipes_fit_an_h200(name, world_size):
    device, host = size_terms(load_recipe(name, world_size=world_size), on_cuda=True)
    assert sum(t.nbytes for t in device) < H200_FREE / 3  # not refused, with a wide margin
    assert sum(t.nbytes for t in host) < 20 * GiB  # offloaded states and data per rank: the box has 128+ GiB


@pytest.mark.parametrize("name", ["quickstart", "python-stdlib"])
def test_cpu_recipes_need_under_a_gib(name):
    device, host = size_terms(load_recipe(name), on_cuda=False)
    assert sum(t.nbytes for t in host) < GiB


def test_where_the_bf16_step_is_the_peak_the_summary_says_so_and_its_terms_add_up():
    """optimizer.state_dtype bf16 with tiny activations: the optimizer step's fp32 temporaries outweigh them, so the
    predicted peak is the step's moment (model states and the temporaries) and `toolkit estimate` names it."""
    from toolkit.observe.memory_fit import format_peak_summary
    from toolkit.observe.peak import predict_peak

    tiny = ["precision.dtype=bf16", "optimizer.state_dtype=bf16", "batch.micro_batch_per_rank=1",
            "batch.global_batch=1", "data.seq_len=8"]
    for overrides, step_peak in ((tiny, True), (tiny[:2], False)):
        recipe = load_recipe("quickstart", overrides)
        p = predict_peak(recipe, on_cuda=True)
        assert (p.step_temporaries > 0) == step_peak
        assert p.allocated == p.states + p.weight_cache + p.activations + p.logits + p.step_temporaries
        summary = format_peak_summary(recipe, "H100-80GB")
        assert ("the bf16 optimizer step's fp32 temporaries" in summary) == step_peak
        assert ("+ activations" in summary) != step_peak
