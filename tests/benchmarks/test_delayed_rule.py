"""benchmarks/delayed_rule.py: the hand-written rule is the delayed engine when it delays every parameter, and the
exact engine when it delays none (--delayed-only), bit for bit."""
from benchmarks.delayed_rule import main


def test_the_rule_delaying_all_is_delayed_and_delaying_none_is_exact(capsys):
    common = ["--steps", "6", "--warmup", "2", "--eval-every", "6", "quickstart", "training.device=cpu"]
    everything = main(common)["losses"]
    assert everything["rule"] == everything["delayed"] != everything["exact"]
    nothing = main(["--delayed-only", "no parameter is called this", *common])["losses"]
    assert nothing["rule"] == nothing["exact"] != nothing["delayed"]
    assert "the rule delays 0 of" in capsys.readouterr().out
