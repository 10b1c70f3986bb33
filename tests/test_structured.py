"""Grammar-constrained decoding on the real models: every completed output obeys its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from tianxia import LLM, SamplingParams

SEEDS = range(20)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "status": {"enum": ["new", "paid", "shipped"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "total": {"type": "number", "minimum": 0, "maximum": 1000},
            "gift": {"type": "boolean"},
        },
        "required": ["status", "items", "total", "gift"],
        "additionalProperties": False,
    },
}

# bounded (at most three terms, one level of parentheses) so that sampled outputs finish
EBNF = r"""
root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]?
"""
LARK = r"""
start: expr
expr: term | term OP term | term OP term OP term
term: NUM | "(" NUM OP NUM ")"
OP: "+" | "-" | "*"
NUM: /[1-9][0-9]?/
"""


def _run(llm: LLM, prompt: str, constraint: dict, max_tokens: int = 96):
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=constraint)
        for s in SEEDS
    ]
    outs = [o.outputs[0] for o in llm.generate([prompt] * len(params), params)]
    done = [o for o in outs if o.finish_reason == "stop"]
    # fail closed: whatever did not complete says so, and most runs do complete
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert len(done) >= 15, [o.text for o in outs]
    return done


@pytest.fixture(params=["smollm2", "qwen"])
def llm(request, smollm2_llm):
    return smollm2_llm if request.param == "smollm2" else request.getfixturevalue("qwen_llm")


@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(llm, schema_name):
    schema = SCHEMAS[schema_name]
    for out in _run(llm, f"Write a JSON {schema_name}:\n", {"json": schema}):
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_ebnf(llm):
    pattern = r"(\+1 )?\(\d{3}\) \d{3}-\d{4}"
    for out in _run(llm, "A US phone number: ", {"regex": pattern}, max_tokens=32):
        assert re.fullmatch(pattern, out.text), out.text
    choices = ["positive", "negative", "neutral"]
    for out in _run(llm, "Review: 'great food!' Sentiment:", {"choice": choices}, max_tokens=8):
        assert out.text in choices
    parser = lark.Lark(LARK)
    for out in _run(llm, "An arithmetic expression: ", {"grammar": EBNF}, max_tokens=40):
        parser.parse(out.text)
    for out in _run(llm, "A JSON object describing a cat: ", {"json_object": True}, max_tokens=64):
        assert isinstance(json.loads(out.text), dict)


def test_unconstrained_and_constrained_share_a_batch(smollm2_llm):
    free = SamplingParams(temperature=0, max_tokens=12)
    con = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "[0-9]{4}"})
    outs = smollm2_llm.generate(["The capital of France is", "The year was", "Hello"], [free, con, free])
    alone = smollm2_llm.generate(["The capital of France is", "Hello"], free)
    assert re.fullmatch("[0-9]{4}", outs[1].outputs[0].text)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == alone[1].outputs[0].token_ids


def test_hitting_max_tokens_is_reported_as_length(smollm2_llm):
    out = smollm2_llm.generate(
        "JSON:", SamplingParams(temperature=0, max_tokens=5, structured_outputs={"json": SCHEMAS["order"]})
    )[0].outputs[0]
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"regex": "(unclosed"}, "invalid regex"),
        ({"grammar": "root ::= undefined_rule"}, "invalid grammar"),
        ({"json": "{not json"}, "invalid JSON schema"),
        ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "invalid json"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"regex": "\U00040000"}, "cannot be met"),  # no token can spell U+40000
    ],
)
def test_invalid_constraints_fail_closed(smollm2_llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        smollm2_llm.generate("x", SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished_requests()


def test_a_constraint_that_dead_ends_fails_only_its_request(smollm2_llm):
    engine = smollm2_llm.engine
    dead = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "a\U00040000"})
    disjoint = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[0-9]+"},
                              allowed_token_ids=[smollm2_llm.get_tokenizer().encode("a")[0]])
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = smollm2_llm.generate(["x", "y", "The capital of France is"], [dead, disjoint, free])
    for out in outs[:2]:
        assert out.outputs[0].finish_reason == "abort"
        assert "no token of the vocabulary satisfies" in out.outputs[0].stop_reason
    assert outs[0].outputs[0].text == "a"
    assert outs[2].outputs[0].finish_reason == "length" and len(outs[2].outputs[0].token_ids) == 8
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
