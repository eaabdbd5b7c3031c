"""LLM.beam_search against the same search run on transformers' logprobs, beam width 1 against greedy decoding,
EOS and length limits, and the parameter checks."""
import pytest
import torch

from jvllm import BeamSearchParams, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):"]


def reference_search(model, prompt_ids: list[int], width: int, max_tokens: int, eos: set[int],
                     length_penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's beam search written directly over transformers' float64 log-softmax: (tokens, cum_logprob), best
    first."""
    live, finished = [(list(prompt_ids), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (finished if token in eos else candidates).append((tokens + [token], cum + value))
        live = sorted(candidates, key=lambda beam: beam[1], reverse=True)[:width]
        if not live:
            break

    def score(beam):
        length = len(beam[0]) - (beam[0][-1] in eos)
        return beam[1] / length ** length_penalty

    return sorted(finished + live, key=score, reverse=True)[:width]


# a beam's score is cum_logprob / length ** length_penalty: 0.5 also checks that the penalty reaches the ranking
@pytest.mark.parametrize("length_penalty", [pytest.param(1.0, marks=pytest.mark.extended), 0.5])
def test_beams_match_the_search_over_transformers_logprobs(default_engine, hf_smollm, length_penalty):
    tokenizer = default_engine.get_tokenizer()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with a number."}],
                                         add_generation_prompt=True, tokenize=False)
    prompts = PROMPTS + [chat]  # the chat's short answers end in EOS within the budget
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty)
    outputs = default_engine.beam_search(prompts, params)
    eos = set(default_engine.eos_token_ids)
    finished_by_eos = 0
    for prompt, output in zip(prompts, outputs):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = reference_search(hf_smollm, prompt_ids, 3, 8, eos, length_penalty)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        for sequence, (tokens, cum) in zip(output.sequences, expected):
            assert sequence.cum_logprob == pytest.approx(cum, abs=2e-3)
            assert len(sequence.logprobs) == len(tokens) - len(prompt_ids)
            assert sequence.text == tokenizer.decode(tokens)
            assert sequence.finish_reason == ("stop" if tokens[-1] in eos else "length")
            finished_by_eos += tokens[-1] in eos
    assert finished_by_eos >= 1


def test_beam_width_one_is_greedy_decoding(default_engine):
    tokenizer = default_engine.get_tokenizer()
    greedy = default_engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    beams = default_engine.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    for prompt, output, beam in zip(PROMPTS, greedy, beams):
        (sequence,) = beam.sequences
        assert sequence.tokens == tokenizer.encode(prompt) + list(output.outputs[0].token_ids)


def test_ignore_eos_and_the_model_length_bound_the_beams(default_engine):
    chat = default_engine.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Say yes."}], add_generation_prompt=True, tokenize=False)
    (output,) = default_engine.beam_search(chat, BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    prompt_len = len(default_engine.get_tokenizer().encode(chat, add_special_tokens=False))
    assert [len(s.tokens) - prompt_len for s in output.sequences] == [5, 5]
    assert all(s.finish_reason == "length" for s in output.sequences)
    max_len = default_engine.config.max_model_len
    long_prompt = {"prompt_token_ids": [100 + i % 500 for i in range(max_len - 2)]}
    (output,) = default_engine.beam_search(long_prompt, BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert [len(s.tokens) for s in output.sequences] == [max_len, max_len]


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
])
def test_bad_parameters_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_extreme_length_penalties_still_rank(default_engine):
    for penalty in (1e308, -1e308):
        (output,) = default_engine.beam_search("Hi", BeamSearchParams(beam_width=2, max_tokens=2,
                                                                      length_penalty=penalty))
        assert len(output.sequences) == 2


def test_bad_calls_raise(default_engine):
    with pytest.raises(TypeError, match="BeamSearchParams"):
        default_engine.beam_search("Hi", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="at least one prompt"):
        default_engine.beam_search([], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        default_engine.beam_search("", BeamSearchParams(beam_width=2, max_tokens=4))
