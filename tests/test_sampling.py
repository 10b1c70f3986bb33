"""The sampling and decoding surface with vLLM semantics, on the real SmolLM2 model."""

from __future__ import annotations

import pytest
import torch

from tianxia import LLM, BeamSearchParams, SamplingParams
from tianxia.engine.output_processor import OutputProcessor, engine_params
from tianxia.engine.sequence import Sequence
from tianxia.layers.sampler import (
    NUCLEUS_BINS,
    NUCLEUS_SPAN,
    TOP_P_CANDIDATES,
    Sampler,
    SamplingBatch,
    apply_top_k_top_p,
)
from tianxia.quant.cpu_kernels import extension

PROMPTS = ["The capital of France is", "def add(a, b):", "My favourite season is"]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logprobs": 100}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"logit_bias": {1: 500}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"), ({"seed": "x"}, "seed"), ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_token_ids_outside_vocab_are_rejected(smollm2_llm):
    with pytest.raises(ValueError, match="logit_bias"):
        smollm2_llm.generate("hi", SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished_requests()


# --- truncation equals greedy ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs",
    [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"temperature": 0.0, "top_k": 5, "top_p": 0.5}],
)
def test_degenerate_truncation_equals_greedy(smollm2_llm, kwargs):
    greedy = _tokens(smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12)))
    params = SamplingParams(**{"temperature": 1.0, "seed": 7, "max_tokens": 12, **kwargs})
    assert _tokens(smollm2_llm.generate(PROMPTS, params)) == greedy


# --- penalties and logit bias: exactly the reference formula on transformers' logits ---------------

def test_penalties_and_logit_bias_match_reference(smollm2_llm, smollm2_reference):
    tok = smollm2_llm.get_tokenizer()
    prompt = tok.encode("the cat and the dog and the cat")
    output = tok.encode(" and the bird and the cat the", add_special_tokens=False)
    with torch.no_grad():
        logits = smollm2_reference(torch.tensor([prompt + output])).logits[0, -1].float()
    bias = {output[0]: 5.0, 100: -3.0, 2000: 2.5}
    params = SamplingParams(
        temperature=0, presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3,
        logit_bias=bias, max_tokens=50,
    )
    seq = Sequence("r", None, prompt, params)
    seq.token_ids += output
    batch = SamplingBatch.from_sequences([seq], eos_ids=(2,))
    ours = Sampler().process(logits.clone()[None], batch)[0]

    ref = logits.clone()
    for t, b in bias.items():
        ref[t] += b
    for t in set(prompt) | set(output):  # repetition: prompt and output tokens
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
    for t in set(output):  # frequency and presence: output tokens only
        ref[t] -= 0.3 * output.count(t) + 0.7
    assert torch.allclose(ours, ref, rtol=0, atol=1e-5)


# --- logprobs ---------------------------------------------------------------------------------------

def test_logprobs_and_prompt_logprobs_match_transformers(smollm2_llm, smollm2_reference):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = smollm2_llm.generate("The three primary colors are", params, use_tqdm=False)[0]
    prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
    with torch.no_grad():
        ref = smollm2_reference(torch.tensor([prompt + gen])).logits[0].float().log_softmax(-1)

    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry and len(entry) in (3, 4)
        for t, lp in entry.items():
            assert abs(lp.logprob - ref[pos - 1, t].item()) < 1e-4
        top3 = ref[pos - 1].topk(3).indices.tolist()
        assert [t for t, lp in entry.items() if lp.rank <= 3] == top3 or set(top3) <= set(entry)

    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(gen)
    total = 0.0
    for i, (token, entry) in enumerate(zip(gen, logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < 1e-4
            assert lp.rank == int((row > row[t]).sum()) + 1
        total += row[token].item()
    assert abs(out.outputs[0].cumulative_logprob - total) < 1e-3


# --- seeds ------------------------------------------------------------------------------------------

def test_seed_is_per_request(smollm2_llm, smollm2_path):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    target = "Write a short poem about the sea."
    alone = _tokens(smollm2_llm.generate(target, seeded, use_tqdm=False))[0]

    prompts, params = [], []
    for i in range(16):
        prompts.append(target if i == 5 else f"Prompt number {i}: tell me about")
        params.append(seeded if i == 5 else SamplingParams(
            temperature=0.8, seed=i if i % 2 else None, max_tokens=10 + i, ignore_eos=True))
    batched = _tokens(smollm2_llm.generate(prompts, params))
    assert batched[5] == alone

    other = LLM(str(smollm2_path), kv_cache_memory="64MiB", seed=123, cpu_activations="float32")
    assert _tokens(other.generate(target, seeded, use_tqdm=False))[0] == alone
    different = SamplingParams(temperature=1.0, top_p=0.95, seed=43, max_tokens=16, ignore_eos=True)
    assert _tokens(smollm2_llm.generate(target, different, use_tqdm=False))[0] != alone


def test_unseeded_requests_vary(smollm2_llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = {tuple(t) for t in _tokens(smollm2_llm.generate(["Once upon a time"] * 4, p))}
    assert len(outs) > 1


# --- the sampled distribution -------------------------------------------------------------------------

@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_truncation_among_the_largest_logits_equals_a_full_sort(cpu_kernels):
    # nuclei of top-p 0.95 that end inside the first candidates and past them (found by the
    # bins of nucleus_floor: from a few hundred to a quarter of the vocabulary); rows with top-k, with
    # both, and with neither, in one batch over a shuffled vocabulary
    vocab, top_p = 49152, 0.95
    widths = [10, TOP_P_CANDIDATES[0] + 1, 2500, 6096, 12000]
    rows, top_k, p = [], [], []
    for n in widths:  # probabilities r^i with the mass before token n - 1/2 exactly 1 - (1 - p)
        r = (1 - top_p) ** (1 / (n - 0.5))
        rows.append(torch.arange(vocab, dtype=torch.float64) * torch.log(torch.tensor(r, dtype=torch.float64)))
        top_k.append(0)
        p.append(top_p)
    gen = torch.Generator().manual_seed(0)
    for k, pp in ((0, 1.0), (50, 1.0), (5, 0.5)):
        rows.append(torch.randn(vocab, generator=gen, dtype=torch.float64) * 3)
        top_k.append(k)
        p.append(pp)
    logits = torch.stack(rows).float()
    logits = logits[:, torch.randperm(vocab, generator=gen)]
    top_k, p = torch.tensor(top_k), torch.tensor(p)
    # the CPU kernels find top-p floors where autograd is off, as in the engine
    with torch.inference_mode(cpu_kernels):
        got = apply_top_k_top_p(logits, top_k, p, True, True)

    for i in range(len(logits)):  # the reference: sort everything, then vLLM's rule in float64
        values, order = logits[i].double().sort(descending=True)
        k = int(top_k[i]) or vocab
        probs = values[:k].softmax(-1)
        kept = order[:k][(probs.cumsum(0) - probs) < p[i]]
        assert torch.equal((got[i] > float("-inf")).nonzero().flatten(), kept.sort().values), i
        assert torch.equal(got[i, kept], logits[i, kept])
    assert [int((got[i] > float("-inf")).sum()) for i in range(len(widths))] == widths


def _min_p_kept(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """Which logits min-p keeps: p >= min_p * p_max, i.e. x >= max + ln(min_p) (float32, as the
    engine computes the floor)."""
    if min_p <= 0:
        return torch.ones_like(x, dtype=torch.bool)
    return x >= x.max() + torch.tensor(min_p).log()


def test_the_kernels_top_k_floor_equals_a_full_sort():
    # top-k alone, top-k then top-p over the renormalized k (vLLM's order), a k past the first
    # collection's doubling, rows that keep 1 or all but one token, and min-p first (as vLLM
    # applies it), with fewer tokens above its floor than the k or more
    kernels = extension()
    if kernels is None:
        pytest.skip("the CPU kernels are not built here")
    vocab = 49152
    gen = torch.Generator().manual_seed(3)
    cases = [(1, 1.0, 0.0), (40, 1.0, 0.0), (40, 0.9, 0.0), (50, 0.3, 0.0), (1000, 0.95, 0.0),
             (20000, 0.99, 0.0), (vocab - 1, 1.0, 0.0), (7, 0.0, 0.0),
             (40, 0.95, 0.05), (5, 1.0, 0.3), (1000, 0.9, 0.01), (200, 1.0, 0.002)]
    logits = (torch.randn(len(cases), vocab, generator=gen, dtype=torch.float64) * 3).float()
    top_k = torch.tensor([k for k, _, _ in cases])
    top_p = torch.tensor([p for _, p, _ in cases])
    min_p = torch.tensor([m for _, _, m in cases])
    floor = kernels.top_k_floor(logits, top_k, top_p, min_p)
    for i, (k, p, m) in enumerate(cases):
        above = _min_p_kept(logits[i], m)
        values, order = logits[i].double().masked_fill(~above, float("-inf")).sort(descending=True)
        k = min(k, int(above.sum()))
        probs = values[:k].softmax(-1)
        kept = (probs.cumsum(0) - probs) < p
        kept[0] = True  # the largest logit always stays
        expected = order[:k][kept].sort().values
        assert torch.equal((logits[i] >= floor[i]).nonzero().flatten(), expected), (k, p, m)
    assert 0 < int(_min_p_kept(logits[9], 0.3).sum()) < 5  # the min-p row with fewer than its k
    no_k = kernels.top_k_floor(logits, torch.tensor([0, vocab] * (len(cases) // 2)), top_p, min_p)
    assert bool(torch.isneginf(no_k).all())


def _hashed_race(x: torch.Tensor, key: tuple[int, int], floor: float) -> int:
    """The kernels' draw computed for every logit, in float64: argmax of x + -log(-log u) over
    the logits at or above the floor, u from the lowbias32 hash of (key, token id)."""
    def mix(h: torch.Tensor) -> torch.Tensor:
        m = 0xFFFFFFFF
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & m
        h = h ^ (h >> 15)
        h = (h * 0x846CA68B) & m
        return h ^ (h >> 16)

    ids = torch.arange(x.shape[0], dtype=torch.int64)
    h = mix(mix(ids ^ key[0]) ^ key[1])
    u = ((h >> 8).double() + 0.5) / 2 ** 24
    score = x.double() - (-u.log()).log()
    return int(score.masked_fill(x < floor, float("-inf")).argmax())


def _nucleus_floor_by_sort(x: torch.Tensor, p: float, min_p: float) -> float:
    """The smallest logit of the top-p nucleus of the distribution above min-p's floor: a full
    sort and vLLM's rule (a token stays while the mass before it is below p), in float64."""
    above = _min_p_kept(x, min_p)
    values = x[above].double().sort(descending=True).values
    if p >= 1:
        return float(values[-1])
    probs = values.softmax(-1)
    kept = (probs.cumsum(0) - probs) < p
    kept[0] = True
    return float(values[kept][-1])


def test_the_kernels_race_equals_the_race_over_every_logit():
    # the kernel computes the noise only of logits that may still win, draws a top-p row before
    # it checks its nucleus, and finds min-p's floor itself: the tokens must be those of the full
    # race over the nucleus of the distribution above that floor
    kernels = extension()
    if kernels is None:
        pytest.skip("the CPU kernels are not built here")
    rows, vocab = 64, 4099  # a tail past the vectors of 8
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 6.0, rows)[:, None]
    keys = torch.randint(0, 2 ** 32, (rows, 2), generator=gen)
    no_floor = torch.full((rows,), float("-inf"))
    for p, m in ((1.0, 0.0), (0.9, 0.0), (0.5, 0.0), (1.0, 0.05), (0.9, 0.02), (0.5, 0.2)):
        got = kernels.race_draw(logits, no_floor, keys, torch.full((rows,), p), torch.full((rows,), m),
                                NUCLEUS_BINS, NUCLEUS_SPAN)
        want = [_hashed_race(logits[r], (int(keys[r, 0]), int(keys[r, 1])), _nucleus_floor_by_sort(logits[r], p, m))
                for r in range(rows)]
        assert got.tolist() == want, (p, m)



def _chi2_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test, rare categories merged so each expects at least 5."""
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2), torch.tensor(chi2 / 2)))


def _unseeded_batch(rows: int, **params) -> SamplingBatch:
    """A step of ``rows`` engine sequences of one request's parameters, none seeded."""
    shared = SamplingParams(**params)
    return SamplingBatch.from_sequences([Sequence(str(i), None, [0], shared) for i in range(rows)], eos_ids=())


@pytest.mark.parametrize("kwargs", [
    {},  # every token kept: the draw splits between the largest logits and the rest
    {"top_p": 0.5},  # a nucleus among the largest logits
    {"top_p": 0.97},  # a nucleus wider than them, found by its floor
    {"top_k": 300, "top_p": 0.99},
    {"min_p": 0.002, "temperature": 0.9},  # most tokens above the floor
    {"min_p": 0.05},  # every token above the floor among the first candidates
    {"min_p": 0.01, "top_p": 0.8},  # top-p over the distribution above min-p's floor
    {"min_p": 0.02, "top_k": 30, "top_p": 0.9},
])
@pytest.mark.parametrize("host_kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_unseeded_draws_match_the_truncated_softmax(kwargs, host_kernels):
    # a row with a peak and a long flat tail, whose largest TOP_P_CANDIDATES[0] logits hold only
    # part of the mass; many copies of it in one batch, sampled from the shared generator
    vocab, rows = 8192, 4096
    gen = torch.Generator().manual_seed(1)
    logits = torch.cat([torch.linspace(4.0, 0.5, 64), torch.randn(vocab - 64, generator=gen) * 0.3 - 1.0])
    logits = logits[torch.randperm(vocab, generator=gen)]
    opts = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **kwargs}
    sampler = Sampler(seed=7, host_kernels=host_kernels)
    batch = _unseeded_batch(rows, **opts)
    with torch.inference_mode():  # as the engine samples (the CPU kernels take no autograd)
        tokens = sampler(logits.repeat(rows, 1), batch).tokens

    # the reference: a full sort and vLLM's rules in float64
    scaled = logits.double() / opts["temperature"]
    probs = scaled.softmax(-1)
    if opts["min_p"]:
        probs = torch.where(probs >= opts["min_p"] * probs.max(), probs, 0.0)
    values, order = probs.sort(descending=True)
    k = opts["top_k"] or vocab
    values = values[:k] / values[:k].sum()
    kept = (values.cumsum(0) - values) < opts["top_p"]
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[order[:k][kept]] = values[kept] / values[kept].sum()
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "sampled a token outside the truncated set"
    # the 40 likeliest tokens one by one, then the others of the first candidates, then the rest
    ranked = expected.argsort(descending=True)
    groups = [ranked[i:i + 1] for i in range(40)] + [ranked[40:TOP_P_CANDIDATES[0]], ranked[TOP_P_CANDIDATES[0]:]]
    observed = torch.stack([counts[g].sum() for g in groups])
    exp = torch.stack([expected[g].sum() for g in groups]) * rows
    assert _chi2_p_value(observed, exp) > 1e-3


@pytest.mark.parametrize("kwargs", [{"top_k": 6}, {"top_p": 0.6}, {"top_k": 10, "top_p": 0.8, "temperature": 0.7}])
def test_sampled_frequencies_match_truncated_softmax(smollm2_llm, kwargs):
    prompt = "My favourite colour is"
    ids = smollm2_llm.get_tokenizer().encode(prompt)
    logits = smollm2_llm.engine.score(ids)[-1]
    temp = kwargs.get("temperature", 1.0)
    probs = (logits / temp).softmax(-1)
    order = probs.argsort(descending=True)
    keep = order[: kwargs.get("top_k", len(order))]
    if "top_p" in kwargs:  # as vLLM: top-p over the distribution renormalized after top-k
        p = probs[keep] / probs[keep].sum()
        keep = keep[(p.cumsum(0) - p) < kwargs["top_p"]]
    expected = probs[keep] / probs[keep].sum()

    # the n sequences of a request with seed s use seeds s, s+1, ...: keep the requests' ranges apart
    requests, n = 12, 128
    draws = requests * n
    params = [SamplingParams(n=n, max_tokens=1, seed=10_000 * (i + 1), temperature=temp,
                             **{k: v for k, v in kwargs.items() if k != "temperature"}) for i in range(requests)]
    outs = smollm2_llm.generate([prompt] * requests, params)
    counts: dict[int, int] = {}
    for out in outs:
        for c in out.outputs:
            counts[c.token_ids[0]] = counts.get(c.token_ids[0], 0) + 1
    assert set(counts) <= set(keep.tolist()), "sampled a token outside the truncated set"
    observed = torch.tensor([counts.get(t, 0) for t in keep.tolist()], dtype=torch.float64)
    p_value = _chi2_p_value(observed, expected.double() * draws)
    assert p_value > 1e-3, f"p={p_value:.2e}"


# --- n > 1 --------------------------------------------------------------------------------------------

def test_n_shares_the_prompt(smollm2_llm):
    engine = smollm2_llm.engine
    prompt = "A long shared prompt about the history of computing, " * 5  # ends mid-block
    n_prompt = len(smollm2_llm.get_tokenizer().encode(prompt))
    assert n_prompt % 16
    before = engine.stats()
    out = smollm2_llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)[0]
    after = engine.stats()
    computed = after["prompt_tokens"] - before["prompt_tokens"]
    assert computed == n_prompt - out.num_cached_tokens  # the prompt is computed once, not 4 times
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert after["num_free_blocks"] == engine.block_manager.num_blocks or after["num_running"] == 0
    # greedy n=2: both copies equal the single greedy output (copy-on-write kept the prompt intact)
    g = smollm2_llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=12), use_tqdm=False)[0]
    single = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert g.outputs[0].token_ids == g.outputs[1].token_ids == single.outputs[0].token_ids


# --- beam search ----------------------------------------------------------------------------------------

def test_beam_width_one_equals_greedy(smollm2_llm):
    greedy = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                  use_tqdm=False)[0]
    beams = smollm2_llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    best = beams[0].sequences[0]
    assert best.tokens[len(greedy.prompt_token_ids):] == greedy.outputs[0].token_ids


def _tiny_char_model(tmp_path, vocab_chars: str):
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(vocab_chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, eos_token_id=1, bos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init, so beams differ
        model.lm_head.weight.mul_(40)
    model.save_pretrained(str(tmp_path))
    fast.save_pretrained(str(tmp_path))
    return model


def _reference_beam_search(model, prompt: list[int], width: int, steps: int, eos: int, lp: float):
    def score(tokens, cum):
        n = len(tokens) - (1 if tokens[-1] == eos else 0)
        return cum / n**lp

    beams, done = [(prompt, 0.0)], []
    for _ in range(steps):
        cands = []
        for tokens, cum in beams:
            with torch.no_grad():
                row = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            vals, ids = row.topk(2 * width)
            for v, t in zip(vals.tolist(), ids.tolist()):
                (done if t == eos else cands).append((tokens + [t], cum + v))
        beams = sorted(cands, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


def test_beam_search_matches_brute_force_reference(tmp_path):
    chars = "abcdefghijklmnopqrstuvwxyz .,"
    model = _tiny_char_model(tmp_path, chars)
    llm = LLM(str(tmp_path), num_kv_blocks=256, seed=0)
    prompt = "the cat sat"
    ids = llm.get_tokenizer().encode(prompt)
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=5, length_penalty=1.0))[0]
    ref = _reference_beam_search(model, ids, 4, 5, eos=1, lp=1.0)
    assert len(out.sequences) == 4
    for ours, (tokens, cum) in zip(out.sequences, ref):
        assert ours.tokens == tokens
        assert abs(ours.cum_logprob - cum) < 1e-4
    # every beam's score is the exact log-probability of its tokens under the model
    for beam in out.sequences:
        with torch.no_grad():
            lps = model(torch.tensor([beam.tokens])).logits[0].float().log_softmax(-1)
        exact = sum(lps[i - 1, beam.tokens[i]].item() for i in range(len(ids), len(beam.tokens)))
        assert abs(beam.cum_logprob - exact) < 1e-4


# --- stop strings, min_tokens, multi-byte text ---------------------------------------------------------

def test_stop_string_spanning_tokens(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    base = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode([t]) for t in base.token_ids]
    i = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    out = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=stop),
                               use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert base.text.startswith(out.text + stop) and stop not in out.text
    inc = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                          include_stop_str_in_output=True), use_tqdm=False)
    assert inc[0].outputs[0].text == out.text + stop


def test_min_tokens_suppresses_eos_and_stop_tokens(smollm2_llm):
    chat = [{"role": "user", "content": "Say hi."}]
    short = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=100))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    eos = smollm2_llm.engine.eos_ids
    out = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=100, min_tokens=40))[0].outputs[0]
    assert len(out.token_ids) >= 40
    assert not set(out.token_ids[:40]) & set(eos)
    stop_tok = short.token_ids[1]
    out = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=60, min_tokens=5,
                                                stop_token_ids=[stop_tok]))[0].outputs[0]
    assert stop_tok not in out.token_ids[:5]


def test_bans_and_biases_of_several_rows_in_one_step(smollm2_llm):
    """Rows with different min_tokens bans and logit biases, sampled in one step (the bans and
    biases of all rows go in as one indexed write): each gets what it gets alone."""
    prompts = ["Say hi.", "My favourite colour is", "Count to 3:"]
    tok = smollm2_llm.get_tokenizer()
    params = [SamplingParams(temperature=0, max_tokens=24, min_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, logit_bias={tok.encode(" blue")[0]: 8.0,
                                                                       tok.encode(" red")[0]: -100.0}),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=6, logit_bias={tok.encode("1")[0]: -5.0})]
    together = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    alone = [smollm2_llm.generate(t, p, use_tqdm=False)[0].outputs[0].token_ids for t, p in zip(prompts, params)]
    assert together == alone
    assert len(together[0]) >= 12 and not set(together[0][:12]) & set(smollm2_llm.engine.eos_ids)


def test_bad_words_and_allowed_token_ids(smollm2_llm):
    base = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "Paris" in base.outputs[0].text
    out = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, bad_words=["Paris"]),
                               use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text
    allowed = base.outputs[0].token_ids[:3]
    out = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=1, max_tokens=6,
                                                          allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)


def test_streamed_multibyte_text_is_never_broken(smollm2_llm):
    engine = smollm2_llm.engine
    tok = smollm2_llm.get_tokenizer()
    prompts = ["你好，世界！我们今天学习中文。你好，世界！", "🙂🚀🎉 emoji party 🙂🚀🎉 more emoji:", "naïve café — déjà vu"]
    non_ascii = 0
    for i, prompt in enumerate(prompts):
        # streamed as the server and the CLI stream: text from the API-side OutputProcessor, each
        # delta the text up to the output's stable_len
        rid, params = f"mb-{i}", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        processor = OutputProcessor(engine.tokenizer)
        processor.add(rid, params)
        engine.add_request(rid, prompt, engine_params(params))
        deltas: list[str] = []
        printed = 0
        while engine.has_unfinished_requests():
            for delta in engine.step_deltas():
                (out,) = processor.process(delta).output.outputs
                deltas.append(out.text[printed:out.stable_len])
                printed = out.stable_len
        full = "".join(deltas)
        assert out.finish_reason == "length"
        assert full == out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        # a replacement character may only appear where the model's bytes really are invalid UTF-8
        assert full.count("\ufffd") == tok.decode(out.token_ids).count("\ufffd")
        if "\ufffd" not in full:
            assert all("\ufffd" not in d for d in deltas), deltas
        non_ascii += sum(ord(c) > 127 for c in full)
    assert non_ascii > 10


def test_detokenize_false_returns_ids_only(smollm2_llm):
    out = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, detokenize=False),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 6
