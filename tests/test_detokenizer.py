"""Incremental detokenization and stop strings on a real (tiny, byte-level BPE) tokenizer."""

from transformers import AutoTokenizer

from kvferry.engine.detokenizer import IncrementalDetokenizer, streamed_text
from kvferry.engine.output_processor import OutputProcessor
from kvferry.messages.engine_core import EngineCoreOutput, FinishReason
from kvferry.sampling_params import SamplingParams

TEXT = " the café serves crème brûlée, 日本語 and 🙂🙂 too"


def test_streamed_text_never_splits_a_character(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok.encode("hello there")
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) / 3  # multi-byte chars really span several tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def _stream(processor, req_id, token_ids, finish_at_end=FinishReason.LENGTH):
    outs = []
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        core_out = EngineCoreOutput(
            req_id, [t], finish_reason=finish_at_end if last else None, num_prompt_tokens=2
        )
        processed = processor.process_outputs([core_out])
        outs.extend(processed.request_outputs)
        if processed.reqs_to_abort:
            return outs, True
    return outs, False


def test_stop_string_truncates_and_is_never_streamed(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok.encode(" one two three four five six", add_special_tokens=False)
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1, 2], SamplingParams(stop=["four"]))
    outs, aborted = _stream(processor, "r", ids)
    assert aborted
    final = outs[-1]
    assert (
        final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "four"
    )
    assert final.outputs[0].text == " one two three "
    assert "".join(o.delta_text for o in outs) == " one two three "
    assert not processor.has_request("r")


def test_stop_token_is_not_in_the_text(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok.encode(" one two", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1, 2], SamplingParams(skip_special_tokens=False))
    outs, _ = _stream(processor, "r", ids, finish_at_end=FinishReason.STOP)
    assert outs[-1].outputs[0].text == " one two"
    assert outs[-1].outputs[0].token_ids == ids


def _sent_so_far(outs):
    tokens: list[int] = []
    text = ""
    for out in outs:
        tokens += out.delta_token_ids
        text += out.delta_text
        yield tokens, text


def test_streamed_deltas_carry_the_tokens_whose_text_they_carry(tiny_llama):
    """A token waits with its pending bytes (and with text held back for a stop string):
    at every delta, the tokens sent so far decode to the text sent so far."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok.encode(TEXT, add_special_tokens=False)
    for params in (SamplingParams(), SamplingParams(stop=["never in the text"])):
        processor = OutputProcessor(tok)
        processor.add_request("r", None, [1, 2], params)
        outs, _ = _stream(processor, "r", ids)
        held = [o for o in outs if not o.delta_text and not o.finished]
        assert held and all(not o.delta_token_ids for o in held)  # bytes or text did wait
        for tokens, text in _sent_so_far(outs):
            assert tok.decode(tokens) == text
        assert tokens == ids and text == tok.decode(ids)


def test_the_text_of_sent_tokens_is_the_text_streamed(tiny_llama):
    """What a continued answer's tool-call parser is primed with (the P/D proxy's failover
    sends the answer's tokens so far): at every delta, the text of the tokens sent so far,
    decoded after the prompt a token at a time, is the text the client got."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok.encode("hello there")
    processor = OutputProcessor(tok)
    processor.add_request("r", None, prompt, SamplingParams())
    outs, _ = _stream(processor, "r", tok.encode(TEXT, add_special_tokens=False))
    for tokens, text in _sent_so_far(outs):
        assert streamed_text(tok, prompt, tokens) == text
