"""Real-text data: tokenizer round trips (byte-level and BPE) on multi-byte text,
packing with end-of-text separators, the split by documents, rank sharding with
every sequence once per epoch, resume to the identical next batch, the token
cache. Corpora are tiny files written to tmp_path (recipes and bad inputs:
tests/data/test_data_recipes.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.read_only_mount import make_read_only
from tests.text_corpus import dataset_for, python_like_docs, text_recipe, write_corpus
from toolkit.cli.main import main as cli_main
from toolkit.data.batches import BatchStream, Dataset, PackedSequences, TokenCorpus, eval_batches, in_validation
from toolkit.errors import UserError
from toolkit.recipe.load import recipe_from_dict
from toolkit.specs import BatchSpec
from toolkit.data.tokenizer import BYTE_VOCAB_SIZE, EOT, byte_tokenizer, load_tokenizer_folder, train_bpe

MULTIBYTE = "naïve café ☕ — 日本語のテキスト, emoji 🎉🐍, Ελληνικά, \t tabs and  spaces\n<|endoftext|> stays text\n"


# ---------------------------------------------------------------------------
# Tokenizers.


def test_byte_tokenizer_round_trips_multibyte_text_and_ids_are_the_utf8_bytes():
    tok = byte_tokenizer()
    ids = tok.encode(MULTIBYTE)
    assert ids == list(MULTIBYTE.encode("utf-8"))          # the literal <|endoftext|> stays bytes
    assert tok.decode(ids) == MULTIBYTE
    assert [list(a) for a in tok.encode_batch([MULTIBYTE, "x"])] == [ids, [ord("x")]]  # the fast path agrees
    assert (tok.vocab_size, tok.eot_id, tok.decode([tok.eot_id])) == (BYTE_VOCAB_SIZE, 256, EOT)


def test_bpe_tokenizer_round_trips_multibyte_text_it_was_not_trained_on():
    tok = train_bpe(python_like_docs(50), vocab_size=400)
    assert 300 < tok.vocab_size <= 400 and tok.eot_id == 0  # a small corpus may run out of merges first
    unseen = MULTIBYTE + "def f():\n    return 'ünïcödé'\n"
    ids = tok.encode(unseen)
    assert tok.decode(ids) == unseen
    assert EOT not in [tok.tokenizer.id_to_token(i) for i in ids]   # text never becomes the separator
    assert [list(a) for a in tok.encode_batch([unseen])] == [ids]
    assert len(tok.encode(python_like_docs(1)[0])) < len(python_like_docs(1)[0].encode()) / 2  # it learned merges


def test_saved_tokenizer_folder_loads_back_and_in_transformers(tmp_path):
    tok = train_bpe(python_like_docs(30), vocab_size=300)
    tok.save(tmp_path / "tok")
    again = load_tokenizer_folder(tmp_path / "tok")
    assert (again.kind, again.eot_id, again.encode(MULTIBYTE)) == ("bpe", tok.eot_id, tok.encode(MULTIBYTE))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert hf.eos_token_id == tok.eot_id
    assert hf.decode(hf("def f(): return 'é'")["input_ids"]) == "def f(): return 'é'"


# NOTE: text transformers and the toolkit could split differently: the literal separator, a NUL, lone CRs,
# characters of 1-4 UTF-8 bytes, runs of spaces.
TRICKY = MULTIBYTE + "\x00\r\r\n  x\u2028𝔘\U0010ffff    def  f():\n\t\treturn 'ünïcödé'<|endoftext|><|endoftext|>"


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_saved_tokenizer_encodes_exactly_like_the_toolkit_in_transformers(tmp_path, kind):
    from transformers import AutoTokenizer

    tok = byte_tokenizer() if kind == "byte" else train_bpe(python_like_docs(30), vocab_size=300)
    tok.save(tmp_path / "tok", model_max_length=64)
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    rng = np.random.default_rng(0)
    randoms = ["".join(map(chr, rng.choice([*range(1, 0xD800), *range(0xE000, 0x11000)], 300))) for _ in range(5)]
    for text in [TRICKY, "", "<|endoftext|>", *randoms]:
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == ids   # the literal <|endoftext|> stays text in both
        assert hf.decode(ids) == tok.decode(ids) == text
    assert (hf.eos_token_id, len(hf), hf.model_max_length) == (tok.eot_id, tok.vocab_size, 64)
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


# ---------------------------------------------------------------------------
# Packing, splitting, the token cache.


def test_packing_joins_documents_with_end_of_text_and_cuts_overlapping_windows(tmp_path):
    docs = ["first doc ✓", "second", "third document here", "4th"]
    ds = dataset_for(tmp_path, {"validation_fraction": 0, "seq_len": 8}, docs=docs)
    stream = np.asarray(ds.corpus.train)
    expected = []
    for doc in docs:  # file order, each document followed by end-of-text
        expected += [*doc.encode("utf-8"), 256]
    assert stream.tolist() == expected
    assert ds.corpus.meta["train_documents"] == 4 and ds.corpus.meta["valid_documents"] == 0
    assert len(ds.train) == (len(expected) - 1) // 8
    batch = ds.train[torch.arange(len(ds.train))]
    assert batch.dtype == torch.int64 and batch.shape == (len(ds.train), 9)
    for i in range(len(ds.train)):
        assert batch[i].tolist() == expected[i * 8:i * 8 + 9]   # neighbours share one token
    assert torch.equal(batch[1:, 0], batch[:-1, -1])


def test_validation_split_is_by_whole_documents_seeded_and_stable(tmp_path):
    docs = python_like_docs(60)
    ds = dataset_for(tmp_path, {"validation_fraction": 0.25}, docs=docs)
    held = [d for d in docs if in_validation(d, 0.25, 0)]
    assert 5 < len(held) < 25
    meta = ds.corpus.meta
    assert (meta["valid_documents"], meta["train_documents"]) == (len(held), len(docs) - len(held))
    assert [d for d in docs if in_validation(d, 0.25, 1)] != held          # data.seed picks another split
    assert [d for d in docs[::-1] if in_validation(d, 0.25, 0)] == held[::-1]  # by content, not position


def test_validation_stream_holds_exactly_the_held_out_documents(tmp_path):
    docs = python_like_docs(60)
    ds = dataset_for(tmp_path, {"validation_fraction": 0.25}, docs=docs)
    held = [d for d in docs if in_validation(d, 0.25, 0)]
    expected = []
    for doc in held:
        expected += [*doc.encode("utf-8"), 256]
    assert np.asarray(ds.corpus.valid).tolist() == expected
    kept = [d for d in docs if d not in held]
    assert len(ds.corpus.train) == sum(len(d.encode()) + 1 for d in kept)


def test_token_cache_is_reused_and_keyed_by_file_bytes_and_settings(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", python_like_docs(20))
    spec = recipe_from_dict(text_recipe(tmp_path)).data
    first = TokenCorpus(spec)
    again = TokenCorpus(spec)
    assert first.built and not again.built and first.dir == again.dir
    assert isinstance(again.train, np.memmap)
    other_split = TokenCorpus(recipe_from_dict(text_recipe(tmp_path, {"validation_fraction": 0.3})).data)
    assert other_split.dir != first.dir
    (corpus / "doc000.txt").write_text("changed text", encoding="utf-8")
    changed = TokenCorpus(spec)
    assert changed.built and changed.dir != first.dir


def test_builders_started_together_tokenize_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    write_corpus(tmp_path / "corpus", python_like_docs(30))
    spec = recipe_from_dict(text_recipe(tmp_path, {"tokenizer": "bpe", "vocab_size": 300})).data
    with ThreadPoolExecutor(3) as pool:  # like ranks that start at once (the lock is a per-file flock)
        corpora = list(pool.map(lambda _: TokenCorpus(spec), range(3)))
    assert sorted(c.built for c in corpora) == [False, False, True]
    assert len({c.dir for c in corpora}) == 1 and len(list((tmp_path / "cache").glob("bpe-*"))) == 1
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_bpe_is_trained_once_cached_and_saved_into_the_run_dir(tmp_path):
    write_corpus(tmp_path / "corpus", python_like_docs(40))
    recipe = recipe_from_dict(text_recipe(tmp_path, {"tokenizer": "bpe", "vocab_size": 300}))
    assert recipe.model.vocab_size == 300
    lines = []
    ds = Dataset(recipe.data, run_dir=tmp_path / "run", log=lines.append)
    assert any("trained a BPE tokenizer" in line for line in lines)
    saved = load_tokenizer_folder(tmp_path / "run" / "tokenizer")
    assert saved.encode(MULTIBYTE) == ds.tokenizer.encode(MULTIBYTE)
    lines.clear()
    Dataset(recipe.data, log=lines.append)
    assert lines == []  # tokenizer and tokens both from the cache
    assert len(list((tmp_path / "cache").glob("bpe-*"))) == 1


def test_only_rank_0_writes_the_tokenizer_into_the_run_dir(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", python_like_docs(40))
    spec = recipe_from_dict(text_recipe(tmp_path, {"tokenizer": "bpe", "vocab_size": 300})).data
    monkeypatch.setenv("RANK", "1")   # torchrun's rank, before a process group is joined
    Dataset(spec, run_dir=tmp_path / "run1")
    assert not (tmp_path / "run1" / "tokenizer").exists()
    monkeypatch.setenv("RANK", "0")
    ds = Dataset(spec, run_dir=tmp_path / "run0")
    assert load_tokenizer_folder(tmp_path / "run0" / "tokenizer").encode(MULTIBYTE) == ds.tokenizer.encode(MULTIBYTE)
    Dataset(spec, run_dir=tmp_path / "run0")  # a resumed run replaces the files, leaving no temp files
    files = sorted((tmp_path / "run0" / "tokenizer").iterdir())
    assert [p.name for p in files] == ["tokenizer.json", "tokenizer_config.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in files} == {0o666 & ~umask}   # not private temp files


def _dataset_rank(rank: int, spec, root: Path) -> None:
    """One of two gloo ranks building the same Dataset into one run dir; records what it did."""
    import torch.distributed as dist

    import toolkit.data.tokenizer

    torch.set_num_threads(1)
    saves = []
    save = toolkit.data.tokenizer.TextTokenizer.save
    toolkit.data.tokenizer.TextTokenizer.save = lambda self, folder, **kw: saves.append(str(folder)) or save(self, folder,
                                                                                                         **kw)
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2)
    try:
        ds = Dataset(spec, run_dir=root / "run")
        dist.barrier()
        result = {"built": ds.corpus.built, "saves": saves, "train": np.asarray(ds.corpus.train).tolist()}
        (root / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_build_the_cache_once_and_rank_0_alone_writes_the_run_dir(tmp_path):
    import multiprocessing

    write_corpus(tmp_path / "corpus", python_like_docs(40))
    spec = recipe_from_dict(text_recipe(tmp_path, {"tokenizer": "bpe", "vocab_size": 300})).data
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_dataset_rank, args=(rank, spec, tmp_path)) for rank in range(2)]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(120)
    assert [proc.exitcode for proc in ranks] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert sorted([r0["built"], r1["built"]]) == [False, True]   # one tokenized, the other read its cache
    assert r0["train"] == r1["train"]
    run_saves = [s for r in (r0, r1) for s in r["saves"] if s.startswith(str(tmp_path / "run"))]
    assert r0["saves"][-1:] == [str(tmp_path / "run" / "tokenizer")] and run_saves == r0["saves"][-1:]
    assert len([s for r in (r0, r1) for s in r["saves"]]) == 2     # the BPE was trained (and cached) once
    assert sorted(p.name for p in (tmp_path / "run" / "tokenizer").iterdir()) == ["tokenizer.json",
                                                                                  "tokenizer_config.json"]
    assert len(list((tmp_path / "cache").glob("bpe-*"))) == 1 and not list((tmp_path / "cache").glob(".tmp-*"))


# ---------------------------------------------------------------------------
# Sharding and resume.


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_never_share_a_sequence_and_only_the_last_partial_batch_is_left_out(world):
    seq_len, n = 8, 53
    sequences = PackedSequences(np.arange(n * seq_len + 1, dtype=np.uint16), seq_len)  # sequence i starts at i * 8
    batch = BatchSpec(2, 3, 6 * world, world)
    streams = [BatchStream(sequences, batch, rank=r, seed=7) for r in range(world)]
    steps = streams[0].steps_per_epoch
    assert steps == n // batch.global_batch >= 2
    for _ in range(2):
        per_rank = [[int(row[0]) // seq_len for _ in range(steps) for mb in s.next_step() for row in mb]
                    for s in streams]
        seen = [i for rank in per_rank for i in rank]
        assert len(seen) == len(set(seen)) == steps * batch.global_batch   # no overlap within or across ranks
        assert all(len(rank) == steps * batch.micro_batch_per_rank * batch.grad_accum_steps for rank in per_rank)


@pytest.mark.parametrize("world", [2, 4])
def test_every_sequence_is_seen_exactly_once_per_epoch_when_the_batch_divides_the_corpus(world):
    seq_len, n = 8, 48
    sequences = PackedSequences(np.arange(n * seq_len + 1, dtype=np.uint16), seq_len)  # sequence i starts at i * 8
    batch = BatchSpec(3, 2, 6 * world, world)
    streams = [BatchStream(sequences, batch, rank=r, seed=11) for r in range(world)]
    epochs = []
    for _ in range(2):
        starts = [int(row[0]) // seq_len for _ in range(streams[0].steps_per_epoch) for s in streams
                  for mb in s.next_step() for row in mb]
        assert sorted(starts) == list(range(n))
        epochs.append(starts)
    assert epochs[0] != epochs[1]  # each epoch has its own order


def test_resume_from_a_saved_position_gives_the_identical_next_batch(tmp_path):
    ds = dataset_for(tmp_path, {"validation_fraction": 0, "seq_len": 8})
    batch = BatchSpec(2, 2, 8, 2)
    for stop in (1, 3, 2 * BatchStream(ds.train, batch, 0, 5).steps_per_epoch + 1):  # mid-epoch, later epochs
        for rank in (0, 1):
            uninterrupted = BatchStream(ds.train, batch, rank=rank, seed=5)
            for _ in range(stop):
                uninterrupted.next_step()
            state = json.loads(json.dumps(uninterrupted.state_dict()))   # as a checkpoint stores it
            assert state.pop("corpus") == ds.corpus.key and all(type(v) is int for v in state.values())
            expected = uninterrupted.next_step()
            resumed = BatchStream(Dataset(ds.spec).train, batch, rank=rank, seed=5)  # a new process: cache reload
            resumed.load_state_dict(state)
            got = resumed.next_step()
            assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_resume_refuses_a_position_saved_for_other_data(tmp_path):
    ds = dataset_for(tmp_path, {"validation_fraction": 0, "seq_len": 8})
    stream = BatchStream(ds.train, BatchSpec(2, 1, 2, 1), rank=0, seed=0)
    with pytest.raises(UserError, match="the corpus or its tokenizer changed"):
        stream.load_state_dict({"epoch": 0, "step_in_epoch": 1, "sequences": len(ds.train) + 1})


def test_resumed_real_data_run_continues_with_the_same_losses(tmp_path):
    write_corpus(tmp_path / "corpus", python_like_docs(40))
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps(text_recipe(tmp_path, training={"max_steps": 4, "eval_interval": 0,
                                                                  "eval_batches": 0, "log_interval": 1},
                                              checkpoint={"interval": 2})))
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli_main(["run", str(recipe), "--run-dir", str(full)]) == 0
    assert cli_main(["run", str(recipe), "--run-dir", str(part), "training.max_steps=2"]) == 0
    assert cli_main(["run", str(recipe), "--run-dir", str(part)]) == 0

    def losses(run):
        return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "loss" in m}
    assert losses(part) == losses(full)


def test_eval_batches_spread_over_the_validation_split_and_repeat(tmp_path):
    ds = dataset_for(tmp_path, {"validation_fraction": 0.3, "seq_len": 8})
    batch = BatchSpec(2, 1, 2, 1)
    first, again = eval_batches(ds.eval, batch, 0, 3), eval_batches(Dataset(ds.spec).eval, batch, 0, 3)
    assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, again))
    starts = [row[0].item() for mb in first for row in mb]
    assert len(set(starts)) > 1


@pytest.mark.parametrize("tokenizer", [{"tokenizer": "byte"}, {"tokenizer": "bpe", "vocab_size": 300}])
def test_a_complete_cache_on_a_read_only_mount_is_read_without_writing(tmp_path, monkeypatch, tokenizer):
    write_corpus(tmp_path / "corpus", python_like_docs(30))
    spec = recipe_from_dict(text_recipe(tmp_path, tokenizer)).data
    first = TokenCorpus(spec)
    make_read_only(monkeypatch, tmp_path / "cache")
    again = TokenCorpus(spec)
    assert not again.built and again.dir == first.dir
    assert again.train.tolist() == first.train.tolist() and again.valid.tolist() == first.valid.tolist()


def test_a_missing_cache_entry_on_a_read_only_mount_is_one_line_naming_the_key(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", python_like_docs(30))
    (tmp_path / "cache").mkdir()
    make_read_only(monkeypatch, tmp_path / "cache")
    with pytest.raises(UserError) as refused:
        TokenCorpus(recipe_from_dict(text_recipe(tmp_path)).data)
    assert len(refused.value.lines) == 1
    assert refused.value.lines[0].startswith(f"recipe.data.cache_dir: {tmp_path / 'cache'}: cannot write: "
                                             "Read-only file system (EROFS)"), refused.value.lines


@pytest.mark.parametrize("vocab_size, branching", [(97, 4), (50257, 4), (300, 300)])
def test_synthetic_tokens_follow_the_seeded_chain_one_sequence_at_a_time(vocab_size, branching):
    """markov_chain_tokens builds all sequences position by position in small dtypes; a sequence walked alone with
    int64 draws from the same generators gives the same tokens (and the first draws are the recipe's seed's)."""
    from toolkit.data.batches import markov_chain_tokens
    from toolkit.specs import DataSpec

    spec = DataSpec(kind="synthetic", seq_len=9, vocab_size=vocab_size, branching=branching, num_samples=6,
                    eval_samples=2, seed=3)
    tokens = markov_chain_tokens(spec, 6, stream=1)
    successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3 * 1_000_003 + 7919 * 2)
    first = torch.randint(0, vocab_size, (6,), generator=gen)
    choices = torch.randint(0, branching, (6, 9), generator=gen)
    for i in range(6):
        walk = [int(first[i])]
        for t in range(9):
            walk.append(int(successors[walk[-1], choices[i, t]]))
        assert tokens[i].tolist() == walk
    assert tokens.dtype == torch.long and tokens.shape == (6, 10)
