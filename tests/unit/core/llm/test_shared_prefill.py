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
def test_a_shared_prefill_gives_the_distributions_and_tokens_of_the_plain_generate(
    model_and_tokenizer: tuple, sampling: dict
) -> None:
    """Every row samples from the distribution the plain ``generate`` gives it, step by step (logits to 1e-4: the
    prefill runs in a batch of another size, so the last bits may differ), and so draws the same tokens under one
    seed. Greedy: every row the same. Sampled: a draw that falls within rounding of a boundary between two tokens
    could flip on another CPU's kernels, so two of the 48 rows may differ; none did on the AVX-512 machine."""
    model, tokenizer = model_and_tokenizer
    enc = _groups(tokenizer, answers_per_prompt=16)
    kwargs = {
        "max_new_tokens": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    width = enc["input_ids"].shape[1]
    with torch.no_grad():
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            plain = model.generate(**enc, **kwargs, **sampling)
            torch.manual_seed(seed)
            shared = generate_sharing_prompts(
                model, enc["input_ids"], enc["attention_mask"], **kwargs, **sampling
            )
            same = (shared.sequences == plain.sequences).all(dim=1)
            assert int(same.sum()) >= (48 if not sampling["do_sample"] else 46), seed
            for step, (ours, theirs) in enumerate(zip(shared.logits, plain.logits, strict=True)):
                # rows whose tokens so far agree were asked for the same next-token distribution
                agree = (
                    shared.sequences[:, width : width + step] == plain.sequences[:, width : width + step]
                ).all(1)
                torch.testing.assert_close(ours[agree], theirs[agree], rtol=0, atol=1e-4)
    if sampling["do_sample"]:
        assert (
            len({tuple(r) for r in plain.sequences[:16].tolist()}) > 1
        )  # the group's answers differ: sampled


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
