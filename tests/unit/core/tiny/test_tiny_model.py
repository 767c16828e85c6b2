"""The project's own tiny models: the shipped copy installed into a data root (several installs at once:
tests/integration/test_tiny_model_install.py), and a configured model path that holds no model named in the
error, never built behind it."""

from __future__ import annotations

from pathlib import Path

from support.checkpoint_files import assert_portable_checkpoint


def test_the_saved_model_reads_the_same_under_both_transformers_schemas(tiny_model_dir: Path) -> None:
    """The files say under 4.x's keys what they say under 5.x's (checked by hand under transformers 4.57.6: same
    token ids, logits within 1.3e-7; before, 4.x could not load the tokenizer and took RoPE base 1e6 for 1e4),
    and 5.x still loads them as it did: the model's own RoPE base and the same tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    assert_portable_checkpoint(tiny_model_dir)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.rope_parameters["rope_theta"] == 10000.0  # the preset's, not Mixtral's default 1e6
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|im_end|>"
    assert {"<|im_start|>", "<|im_end|>", "<|eos|>"} <= set(tokenizer.all_special_tokens)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered.startswith("<|im_start|>user")


def test_scaled_rope_is_written_in_the_4x_schema_too() -> None:
    from nexa_dagster.core.training.hf_checkpoint import portable_model_config, portable_tokenizer_config

    yarn = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}}
    assert portable_model_config(yarn) == {
        **yarn,
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    named = {"tokenizer_class": "LlamaTokenizerFast", "extra_special_tokens": {"image_token": "<img>"}}
    assert portable_tokenizer_config(named) == named  # a real class and a dict of named tokens are left alone


def test_the_pretrained_tiny_model_is_built_once_per_machine_and_a_changed_recipe_builds_anew(
    tmp_path: Path, monkeypatch
) -> None:
    """Every data root's tiny teacher is a copy of one cached build; the cache is keyed by what makes the model."""
    from pydoc_data.topics import topics

    from nexa_dagster.core.tiny.pretrain import TinyPretrainRecipe, build_pretrained_tiny_lm

    monkeypatch.setenv("NEXA_MODEL_CACHE", str(tmp_path / "cache"))
    corpus = [topics[k] for k in ("assert", "for", "with", "lambda", "class")]  # small: a fast tokenizer
    recipe = TinyPretrainRecipe(steps=2, batch_size=2)
    first = build_pretrained_tiny_lm(tmp_path / "a" / "models" / "tiny-teacher", recipe, corpus)
    (cached,) = (tmp_path / "cache").glob("tiny-pretrained-*")
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    second = build_pretrained_tiny_lm(tmp_path / "b" / "models" / "tiny-teacher", recipe, corpus)
    assert (second / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp  # copied, not built again
    assert sorted(p.name for p in (tmp_path / "b" / "models").iterdir()) == [
        ".tiny-teacher.lock",
        "tiny-teacher",
    ]
    made = (first / "pretraining.json").read_text()
    assert '"steps": 2' in made and cached.name in made

    build_pretrained_tiny_lm(
        tmp_path / "c" / "models" / "tiny-teacher", TinyPretrainRecipe(steps=3, batch_size=2), corpus
    )
    assert len(list((tmp_path / "cache").glob("tiny-pretrained-*"))) == 2  # another recipe, another build
    build_pretrained_tiny_lm(tmp_path / "d" / "models" / "tiny-teacher", recipe, corpus[:4])
    assert len(list((tmp_path / "cache").glob("tiny-pretrained-*"))) == 3  # another corpus, too


def test_every_data_root_gets_the_shipped_tiny_model_and_nothing_is_built_on_the_machine(
    tmp_path: Path, monkeypatch
) -> None:
    """The tiny teacher/judge is the same bytes on every machine: the repository ships the build of the current
    recipe (a build's weights depend on the CPU's kernels), and a data root's copy comes from it, with the machine's
    cache left empty. A recipe the repository does not ship (a changed prompt, say) has no shipped model."""
    import hashlib

    from nexa_dagster.core.tiny.pretrain import (
        SHIPPED_ROOT,
        TinyPretrainRecipe,
        build_pretrained_tiny_lm,
        default_corpus,
        recipe_key,
        shipped_model,
    )

    key = recipe_key(TinyPretrainRecipe(), default_corpus())
    shipped = shipped_model(key)
    assert shipped is not None, (
        f"no shipped tiny model for recipe {key}: run `make tiny-models` and commit {SHIPPED_ROOT}"
    )
    assert [p.name for p in SHIPPED_ROOT.glob("tiny-pretrained-*")] == [
        shipped.name
    ]  # no stale copy beside it
    monkeypatch.setenv("NEXA_MODEL_CACHE", str(tmp_path / "cache"))
    copy = build_pretrained_tiny_lm(tmp_path / "data" / "models" / "tiny-teacher")

    def digest(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digest(copy) == digest(shipped)
    assert not (tmp_path / "cache").exists()  # nothing was built here
    assert shipped_model(recipe_key(TinyPretrainRecipe(steps=151), default_corpus())) is None


def test_a_configured_model_that_is_not_there_is_an_error_naming_it(tmp_path: Path) -> None:
    """Nothing is built behind a configured path: a missing tiny model says how to install it, a missing real model
    says what the path must hold."""
    import pytest

    from nexa_dagster.core.common.artifacts import require_model_dir
    from nexa_dagster.core.llm.local import LocalTransformersClient

    with pytest.raises(
        FileNotFoundError, match=r"models/tiny-teacher has no config.json.*nexa-dagster tiny-models"
    ):
        require_model_dir(tmp_path / "models" / "tiny-teacher", "teacher model")
    with pytest.raises(FileNotFoundError, match=r"student tokenizer directory .*/llama has no config.json"):
        require_model_dir(tmp_path / "llama", "student tokenizer")
    with pytest.raises(FileNotFoundError, match=r"tiny-judge has no config.json"):
        LocalTransformersClient(tmp_path / "models" / "tiny-judge")
    assert not (tmp_path / "models").exists()  # nothing was built there
