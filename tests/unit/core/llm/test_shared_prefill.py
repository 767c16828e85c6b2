"""Each distinct prompt prefilled once: the same tokens as the plain ``generate``, and the prefill really shared."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nexa_dagster.core.llm.shared_prefill import generate_sharing_prompts
from nexa_dagster.core.tiny.pretrain import build_pretrained_tiny_lm


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    """The shipped pretrained tiny model (its answers are text, so sampling draws from a real distribution)."""
    path = build_pretrained_tiny_lm(tmp_path_factory.mktemp("tiny") / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer


def _groups(tokenizer: object, answers_per_prompt: int) -> dict[str, torch.Tensor]:
    """Three prompts of different lengths (left padding differs per row), each repeated as a group's rows."""
    prompts = [f"Which module is this? {'the list of words ' * n}" for n in (1, 7, 19)]
    rows = [p for p in prompts for _ in range(answers_per_prompt)]
    return tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False)


def _first_forward_rows(model: object, call: object) -> int:
    """How many rows the model's first forward pass read (the prefill), while ``call()`` runs."""
    seen: list[int] = []

    def hook(_module: object, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(ids.shape[0])

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        call()
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize(
    "sampling",
    [{"do_sample": False}, {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}],
    ids=["greedy", "sampled"],
)
def test_a_shared_prefill_gives_the_tokens_of_the_plain_generate(
    model_and_tokenizer: tuple, sampling: dict
) -> None:
    model, tokenizer = model_and_tokenizer
    enc = _groups(tokenizer, answers_per_prompt=16)
    kwargs = {
        "max_new_tokens": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    with torch.no_grad():
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            plain = model.generate(**enc, **kwargs, **sampling)
            torch.manual_seed(seed)
            shared = generate_sharing_prompts(
                model, enc["input_ids"], enc["attention_mask"], **kwargs, **sampling
            )
            assert torch.equal(shared, plain)
    if sampling["do_sample"]:
        assert len({tuple(r) for r in plain[:16].tolist()}) > 1  # the group's answers differ: real sampling


def test_the_prefill_reads_each_distinct_prompt_once_and_unrepeated_rows_as_they_are(
    model_and_tokenizer: tuple,
) -> None:
    model, tokenizer = model_and_tokenizer
    kwargs = {"max_new_tokens": 2, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    groups = _groups(tokenizer, answers_per_prompt=8)
    ids, mask = groups["input_ids"], groups["attention_mask"]
    with torch.no_grad():
        assert _first_forward_rows(model, lambda: generate_sharing_prompts(model, ids, mask, **kwargs)) == 3
        assert (
            _first_forward_rows(
                model, lambda: generate_sharing_prompts(model, ids, mask, share=False, **kwargs)
            )
            == 24
        )
        distinct = _groups(tokenizer, answers_per_prompt=1)
        rows = _first_forward_rows(
            model,
            lambda: generate_sharing_prompts(
                model, distinct["input_ids"], distinct["attention_mask"], **kwargs
            ),
        )
        assert rows == 3
