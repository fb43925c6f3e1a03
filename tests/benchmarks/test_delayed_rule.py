"""benchmarks/delayed_rule.py: the hand-written rule is the delayed engine when it delays every parameter, and the
exact engine when it delays none (--delayed-only) or keeps every slice fresh (--fresh-top 1), bit for bit."""
from benchmarks.delayed_rule import main


def test_the_rule_delaying_all_is_delayed_and_delaying_none_is_exact(capsys):
    common = ["--steps", "6", "--warmup", "2", "--eval-every", "6", "quickstart", "training.device=cpu"]
    everything = main(common)["losses"]
    assert everything["rule"] == everything["delayed"] != everything["exact"]
    nothing = main(["--delayed-only", "no parameter is called this", *common])["losses"]
    assert nothing["rule"] == nothing["exact"] != nothing["delayed"]
    assert "the rule delays 0 of" in capsys.readouterr().out


def test_a_split_keeping_every_slice_fresh_is_exact_and_keeping_half_is_not(capsys):
    common = ["--steps", "6", "--warmup", "2", "--eval-every", "6", "--engines", "rule,exact", "quickstart",
              "training.device=cpu"]
    every = main(["--fresh-top", "1.0", *common])["losses"]
    assert every["rule"] == every["exact"]
    for by in ("grad", "random"):
        half = main(["--fresh-top", "0.5", "--fresh-by", by, *common])["losses"]
        assert half["rule"][:3] == half["exact"][:3] and half["rule"][3:] != half["exact"][3:]
    assert "(10 of 28 tensors)" in capsys.readouterr().out  # the matrices only: 1-d tensors stay fresh
