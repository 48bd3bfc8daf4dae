"""HFTokenizer over a tiny character-level transformers tokenizer written here: bos only where
the tokenizer adds it, stop tokens from a generation config, decode's padding runs and ids it
has no text for."""

import pytest
import transformers as tf  # a test dependency
from recipe_helpers import write_tokenizer

from dualkv_compile.rl import HFTokenizer, final_number


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "tokenizer"
    write_tokenizer(path)
    return path


def test_a_generation_configs_eos_list_stops_responses(folder):
    import json

    tok = HFTokenizer(str(folder))
    end_of_turn = tok.encode("z", add_bos=False)[0]  # any ordinary id stands in for it
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.eos_id, end_of_turn]}))
    tok = HFTokenizer(str(folder))
    assert tok.stop_tokens == tuple(sorted({tok.eos_id, end_of_turn}))
    assert tok.decode(tok.encode("abzcd", add_bos=False)) == "ab"


def test_decode_drops_only_the_padding_runs(folder):
    tok = HFTokenizer(str(folder))
    tok.pad_id = tok.encode("b", add_bos=False)[0]  # an ordinary id as the pad token
    ids = [tok.pad_id] + tok.encode("xbx", add_bos=False) + [tok.pad_id] * 2
    assert tok.decode(ids) == "xbx"


def test_ids_the_tokenizer_cannot_decode_read_as_unknown(folder):
    # an id past the tokenizer's vocabulary (a padded LM head samples them) or its unk was
    # dropped, joining its neighbours: "4", ?, "2" read as 42 and scored as the right answer
    from dualkv_compile.rl.hf_tokenizer import UNKNOWN

    tok = HFTokenizer(str(folder))
    four, two = (tok.encode(c, add_bos=False)[0] for c in "42")
    unk = tok._tok.unk_token_id
    pad = tok._tok.pad_token_id  # not a stop id here: "4 <pad> 2" read as 42 too
    assert pad not in tok.stop_tokens
    for odd in (tok.vocab_size, tok.vocab_size + 100, unk, tok.bos_id, pad):
        text = tok.decode([four, odd, two, tok.eos_id])
        assert text == f"4{UNKNOWN}2" and final_number(text) != "42", (odd, text)
    assert tok.decode([four, two, tok.eos_id]) == "42"


def test_added_special_tokens_read_as_unknown_and_added_text_tokens_as_text(tmp_path, folder):
    # an added token marked special (Llama 3's <|start_header_id|>) but not named among the
    # additional special tokens was dropped too: "4<tool_call>2" read as 42; an added token
    # that is not special (Qwen3's <think>) is text
    from dualkv_compile.rl.hf_tokenizer import UNKNOWN

    fast = tf.PreTrainedTokenizerFast.from_pretrained(folder)
    fast.add_tokens(["<tool_call>"], special_tokens=True)
    fast.add_tokens(["<think>"], special_tokens=False)
    fast.save_pretrained(tmp_path / "added")
    tok = HFTokenizer(str(tmp_path / "added"))
    four, two = (tok.encode(c, add_bos=False)[0] for c in "42")
    call, think = fast.convert_tokens_to_ids(["<tool_call>", "<think>"])
    assert tok.decode([four, call, two, tok.eos_id]) == f"4{UNKNOWN}2"
    assert "<think>" in tok.decode([think, four, two, tok.eos_id])


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory"):
        HFTokenizer(str(tmp_path / "nope"))


def test_decode_strips_left_padding_when_the_pad_id_is_a_stop_id(folder):
    # pad = eos when a tokenizer has no pad token (Qwen3's pad is in its eos list too): the
    # leading padding of a left-padded row is not the stop
    tok = HFTokenizer(str(folder))
    tok.pad_id = tok.stop_tokens[0]
    body = tok.encode("what is 2+2?", add_bos=False)
    row = [tok.pad_id] * 3 + body + [tok.stop_tokens[0]] + [7, 7]
    assert tok.decode(row) == tok.decode(body) != ""


def test_bos_is_added_where_the_tokenizer_adds_it(tmp_path, folder):
    from tokenizers import processors

    tok = HFTokenizer(str(folder))  # names a bos, adds none itself
    assert not tok.adds_bos and tok.encode("ab") == tok.encode("ab", add_bos=False)
    fast = tf.PreTrainedTokenizerFast.from_pretrained(folder)
    bos = fast.bos_token_id
    fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)])
    fast.save_pretrained(tmp_path / "adds")
    tok = HFTokenizer(str(tmp_path / "adds"))
    assert tok.adds_bos and tok.encode("ab") == [bos, *tok.encode("ab", add_bos=False)]
    # a prompt template that writes the bos itself (a chat format pasted in) gets no second
    assert tok.encode("<bos>ab") == tok.encode("ab")
    fast.pad_token = "<bos>"  # bos as the pad: a prompt's bos would read as left padding
    fast.save_pretrained(tmp_path / "bos_pad")
    with pytest.raises(ValueError, match="also its pad id"):
        HFTokenizer(str(tmp_path / "bos_pad"))
