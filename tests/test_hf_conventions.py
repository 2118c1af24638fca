"""generate() as transformers users expect it: BOS / special tokens, generation_config.json, chat templates,
num_return_sequences, token-for-token parity with transformers.generate on tiny random checkpoints."""
import json
import shutil

import numpy as np
import pytest

import jaxdecode
from jaxdecode.genconfig import GenerationConfig, GenerationConfigError
from jaxdecode.options import OptionError
from jd_testutil import make_bos_tokenizer, make_hf_model

N_NEW = 12


def _hf_greedy(hf, ids, max_new_tokens, **kw):
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A Llama checkpoint whose tokenizer adds a BOS, with a ChatML template, and whose
    generation_config.json lists two EOS ids (config.json names only </s>): the second is the token greedy
    decoding emits 4th after the chat prompt, so transformers and jaxdecode must both stop there."""
    import transformers as tf
    d = tmp_path_factory.mktemp("bos_llama")
    hf = make_hf_model("llama", vocab_size=320, seed=3, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    hf.generation_config = tf.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    tok = make_bos_tokenizer(d)
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True,
                                       tokenize=False)
    free = _hf_greedy(hf, tok(chat_ids, add_special_tokens=False).input_ids, N_NEW, eos_token_id=None)
    stop_tok = free[3]
    assert stop_tok not in free[:3]
    hf.generation_config = tf.GenerationConfig(bos_token_id=0, eos_token_id=[1, stop_tok], pad_token_id=1)
    hf.save_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["eos_token_id"] == 1  # only the generation config knows the second EOS
    return d, hf, tok, stop_tok


# A Qwen3-style switch: the template closes an empty think block when enable_thinking is false
THINKING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}{{ 'think: none\n' }}{% endif %}"
            "{% endif %}")


def test_chat_template_kwargs_reach_the_template(bos_model, tmp_path, capsys):
    from jaxdecode.cli import main
    d, _, tok, _ = bos_model
    model = jaxdecode.load(d)
    model.tokenizer.chat_template = THINKING
    conv = [{"role": "user", "content": "def add(a, b):"}]
    off = tok.apply_chat_template(conv, chat_template=THINKING, add_generation_prompt=True, tokenize=True,
                                  return_dict=True, enable_thinking=False)["input_ids"]
    on = tok.apply_chat_template(conv, chat_template=THINKING, add_generation_prompt=True, tokenize=True,
                                 return_dict=True)["input_ids"]
    assert len(off) > len(on)
    r = jaxdecode.generate(model, messages=conv, max_new_tokens=2, chat_template_kwargs={"enable_thinking": False})
    assert r[0].prompt_tokens == off
    assert jaxdecode.generate(model, messages=conv, max_new_tokens=2)[0].prompt_tokens == on
    assert jaxdecode.apply_chat_template(model, conv, {"enable_thinking": False}).endswith("think: none\n")
    with pytest.raises(ValueError, match=r"no prompt is a conversation"):
        jaxdecode.generate(model, "def f(", max_new_tokens=2, chat_template_kwargs={"enable_thinking": False})
    for bad, match in (({"tokenize": True}, r"sets \['tokenize'\], which jaxdecode sets itself"),
                       ({"messages": []}, r"sets \['messages'\]"),
                       ("enable_thinking=False", r"chat_template_kwargs must be a dict of template variables")):
        with pytest.raises(ValueError, match=match):
            jaxdecode.generate(model, messages=conv, max_new_tokens=2, chat_template_kwargs=bad)
    # the CLI's flag, through a checkpoint whose tokenizer has the template
    ckpt = shutil.copytree(d, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=THINKING)))
    for leftover in ckpt.glob("chat_template.jinja"):
        leftover.unlink()
    rc = main(["generate", "--model", str(ckpt), "--chat", "--prompt", "def add(a, b):", "--max-new-tokens", "2",
               "--chat-template-kwargs", '{"enable_thinking": false}', "--json", "--echo"])
    assert rc == 0 and len(json.loads(capsys.readouterr().out.splitlines()[0])["prompt_logprobs"]) == len(off)
    rc = main(["generate", "--model", str(ckpt), "--chat", "--prompt", "x", "--chat-template-kwargs", "{enable"])
    assert rc == 2 and "--chat-template-kwargs '{enable' is not JSON" in capsys.readouterr().err


def test_text_prompts_get_the_tokenizers_bos_and_match_transformers(bos_model):
    d, hf, tok, _ = bos_model
    model = jaxdecode.load(d)
    for prompt in ("def add(a, b):", "import os"):
        ids = tok(prompt).input_ids
        assert ids[0] == 0  # the tokenizer's BOS
        r = jaxdecode.generate(model, prompt, max_new_tokens=N_NEW)[0]
        assert r.prompt_tokens == ids
        assert r.tokens == _hf_greedy(hf, ids, N_NEW)
        no_bos = jaxdecode.generate(model, prompt, max_new_tokens=4, add_special_tokens=False)[0]
        assert no_bos.prompt_tokens == ids[1:]
    ids = [5, 17, 40]  # token ids: used as given, nothing added
    assert jaxdecode.generate(model, ids, max_new_tokens=3)[0].prompt_tokens == ids


def test_generation_config_eos_list_and_chat_template_match_transformers(bos_model):
    d, hf, tok, stop_tok = bos_model
    model = jaxdecode.load(d)
    assert model.generation_config.eos_token_id == (1, stop_tok)
    conv = [{"role": "user", "content": "def add(a, b):"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    expected = _hf_greedy(hf, ids, N_NEW)  # transformers reads generation_config.json: stops at stop_tok
    assert expected[-1] == stop_tok and len(expected) == 4
    r = jaxdecode.generate(model, messages=conv, max_new_tokens=N_NEW)[0]
    assert r.prompt_tokens == ids and r.tokens == expected and r.finish_reason == "eos"
    assert r.text == tok.decode(expected, skip_special_tokens=True)
    kept = jaxdecode.generate(model, messages=conv, max_new_tokens=N_NEW, skip_special_tokens=False)[0]
    assert kept.text == tok.decode(expected, skip_special_tokens=False)
    # A conversation is also an item of prompts (mixed with text in one batch).
    both = jaxdecode.generate(model, [conv, "import os"], max_new_tokens=N_NEW)
    assert both[0].tokens == expected and both[1].prompt_tokens == tok("import os").input_ids
    # An explicit eos_ids wins over the generation config.
    longer = jaxdecode.generate(model, messages=conv, max_new_tokens=N_NEW, eos_ids=[1])[0]
    assert longer.tokens[:4] == expected and len(longer.tokens) > 4


def test_special_tokens_are_skipped_in_text_by_default(bos_model):
    d, _, tok, _ = bos_model
    model = jaxdecode.load(d)
    r = jaxdecode.generate(model, [0, 2, 88], max_new_tokens=6, eos_ids=[])[0]
    assert r.text == tok.decode(r.tokens, skip_special_tokens=True)


def test_generation_config_defaults_and_precedence(bos_model, tmp_path):
    d, _, _, _ = bos_model
    model = jaxdecode.load(d)
    cfg = GenerationConfig(max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5)
    r = jaxdecode.generate(model, "import os", generation_config=cfg, eos_ids=[], seed=1)[0]
    assert r.batch_stats["method"] == "sample" and len(r.tokens) == 3
    assert len(jaxdecode.generate(model, "import os", generation_config=cfg, max_new_tokens=5, eos_ids=[])[0].tokens) == 5
    greedy = jaxdecode.generate(model, "import os", generation_config=cfg, method="greedy", eos_ids=[])[0]
    assert greedy.batch_stats["method"] == "greedy"
    # The same defaults from a checkpoint's generation_config.json (copy the checkpoint, new file).
    d2 = tmp_path / "ckpt"
    shutil.copytree(d, d2)
    (d2 / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 5,
                                                             "max_new_tokens": 3, "eos_token_id": [1, 3],
                                                             "transformers_version": "5.0", "foo": 1}))
    m2 = jaxdecode.load(d2)
    assert m2.generation_config.unused == ("foo",)
    r2 = jaxdecode.generate(m2, "import os", seed=1)[0]
    assert r2.batch_stats["method"] == "sample" and len(r2.tokens) <= 3
    a = jaxdecode.generate(m2, "import os", seed=1, eos_ids=[])[0]
    b = jaxdecode.generate(model, "import os", method="sample", temperature=0.7, top_k=5, max_new_tokens=3,
                           seed=1, eos_ids=[])[0]
    assert a.tokens == b.tokens
    # transformers.GenerationConfig converts (only what it was given).
    import transformers as tf
    c = GenerationConfig.from_transformers(tf.GenerationConfig(do_sample=True, top_p=0.9, eos_token_id=[1, 2]))
    assert (c.do_sample, c.top_p, c.eos_token_id, c.temperature) == (True, 0.9, (1, 2), None)


def test_generation_keys_not_applied_are_a_warning_not_a_silent_difference(bos_model, tmp_path):
    """transformers applies min_new_tokens, bad_words_ids, suppress_tokens, ...; jaxdecode does not, so a
    config that sets them warns and names each; their "off" values do not."""
    import warnings

    import transformers as tf
    d, _, _, _ = bos_model
    d2 = tmp_path / "ckpt"
    shutil.copytree(d, d2)
    (d2 / "generation_config.json").write_text(json.dumps({
        "min_new_tokens": 6, "suppress_tokens": [5], "bad_words_ids": [], "no_repeat_ngram_size": 0,
        "early_stopping": True,  # applied (beam search), so no warning
        "pad_token_id": -1}))  # pad -1: old Llama conversions, accepted
    model = jaxdecode.load(d2)
    assert model.generation_config.not_applied == ("min_new_tokens=6", "suppress_tokens=[5]")
    with pytest.warns(UserWarning, match=r"min_new_tokens=6, suppress_tokens=\[5\]"):
        jaxdecode.generate(model, "import os", max_new_tokens=2)
    # a transformers.GenerationConfig the same way, over the file's: its own value of a key wins
    cfg = tf.GenerationConfig(min_new_tokens=3, forced_eos_token_id=1)
    with pytest.warns(UserWarning, match="forced_eos_token_id=1, min_new_tokens=3, suppress_tokens"):
        jaxdecode.generate(model, "import os", max_new_tokens=2, generation_config=cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxdecode.generate(jaxdecode.load(d), "import os", max_new_tokens=2,
                           generation_config=GenerationConfig.from_dict({"typical_p": 1.0}))
    # a max_new_tokens too long for the model, from the config: the error says where it came from
    from jaxdecode.autoregressive import PromptError
    with pytest.raises(PromptError, match="which the generation config sets"):
        jaxdecode.generate(jaxdecode.load(d), "import os", generation_config=GenerationConfig(max_new_tokens=10**6))
    # top_p = 0 keeps only the most likely token in transformers: top_k = 1 here
    with pytest.warns(UserWarning):  # the file's min_new_tokens
        greedy = jaxdecode.generate(model, "import os", max_new_tokens=4, eos_ids=[])[0].tokens
    zero_p = GenerationConfig(do_sample=True, top_p=0.0)
    with pytest.warns(UserWarning):  # the file's min_new_tokens
        assert jaxdecode.generate(model, "import os", max_new_tokens=4, eos_ids=[], seed=3,
                                  generation_config=zero_p)[0].tokens == greedy


@pytest.fixture(scope="module")
def many_eos_model(tmp_path_factory):
    """A 64-token Llama where 6 ids end a row: beams finish at many lengths, so when a full buffer stops
    a row (early_stopping) decides which beams come back."""
    from jd_testutil import make_checkpoint
    d = make_checkpoint("llama", tmp_path_factory.mktemp("eos64"), vocab_size=64, seed=6)
    return d, make_hf_model("llama", vocab_size=64, seed=6)


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beam_search_equals_transformers_for_each_early_stopping(many_eos_model, early_stopping):
    """Beams and their scores equal transformers.generate(num_beams=...) token for token, with its
    default early_stopping=False (also generate's default here), True and "never"; a generation config
    carries the value like any other."""
    import torch
    d, hf = many_eos_model
    model = jaxdecode.load(d)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 64, n).tolist() for n in (3, 6, 9, 4)]
    width, k, n_new, eos = max(map(len, prompts)), 3, 12, [3, 7, 11, 20, 30, 41]
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, num_beams=k,
                          num_return_sequences=k, length_penalty=1.0, early_stopping=early_stopping,
                          return_dict_in_generate=True, output_scores=True, eos_token_id=eos, pad_token_id=0)
    kw = dict(method="beam", num_beams=k, num_return_sequences=k, length_penalty=1.0, max_new_tokens=n_new,
              eos_ids=eos)
    given = dict(early_stopping=early_stopping) if early_stopping is not False else {}  # False: the default
    ours = jaxdecode.generate(model, prompts, **kw, **given)
    via_config = jaxdecode.generate(model, prompts, **kw,
                                    generation_config=GenerationConfig(early_stopping=early_stopping))
    for i, (r, c) in enumerate(zip(ours, via_config)):
        want = ref.sequences[i, width:].tolist()
        want = next((want[:j + 1] for j, t in enumerate(want) if t in eos), want)
        assert r.tokens == want == c.tokens, f"output {i} (prompt {i // k}, beam {i % k})"
        assert r.stats["beam_scores"] == pytest.approx(float(ref.sequences_scores[i]), abs=1e-4)


def test_early_stopping_changes_the_beams_here(many_eos_model):
    """The case above is one where the rule matters (else its three runs would test one thing)."""
    model = jaxdecode.load(many_eos_model[0])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 64, n).tolist() for n in (3, 6, 9, 4)]
    runs = {str(e): [r.tokens for r in jaxdecode.generate(
        model, prompts, method="beam", num_beams=3, num_return_sequences=3, max_new_tokens=12,
        eos_ids=[3, 7, 11, 20, 30, 41], early_stopping=e)] for e in (False, True, "never")}
    assert runs["False"] != runs["never"] and runs["True"] != runs["False"]
    with pytest.raises(OptionError, match="early_stopping must be True, False or 'never'"):
        jaxdecode.generate(model, prompts, method="beam", early_stopping="sometimes")


def test_num_return_sequences(bos_model):
    d, _, _, _ = bos_model
    model = jaxdecode.load(d)
    out = jaxdecode.generate(model, ["import os", "def add"], method="sample", num_return_sequences=3,
                             max_new_tokens=8, eos_ids=[], seed=0)
    assert [(r.prompt, r.index) for r in out] == [(p, i) for p in ("import os", "def add") for i in range(3)]
    assert len({tuple(r.tokens) for r in out[:3]}) > 1  # independent draws
    beams = jaxdecode.generate(model, "import os", method="beam", num_beams=4, num_return_sequences=2,
                               max_new_tokens=6, eos_ids=[])
    best = jaxdecode.generate(model, "import os", method="beam", num_beams=4, max_new_tokens=6, eos_ids=[])[0]
    assert len(beams) == 2 and beams[0].tokens == best.tokens and beams[1].tokens != best.tokens
    assert beams[0].stats["beam_scores"] >= beams[1].stats["beam_scores"]


def test_bad_input_is_a_clear_error(tiny_gpt2_dir, bos_model):
    model = jaxdecode.load(tiny_gpt2_dir)  # its tokenizer has no chat template
    with pytest.raises(ValueError, match="no chat template"):
        jaxdecode.generate(model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="'role'"):
        jaxdecode.generate(jaxdecode.load(bos_model[0]), messages=[{"content": "hi"}])
    with pytest.raises(OptionError, match="stop"):
        jaxdecode.generate(model, "import os", stop="")
    with pytest.raises(OptionError, match="stop"):
        jaxdecode.generate(model, "import os", stop=["\n", ""])
    with pytest.raises(OptionError, match="greedy decoding gives the same sequence"):
        jaxdecode.generate(model, "import os", num_return_sequences=2)
    with pytest.raises(OptionError, match="num_beams"):
        jaxdecode.generate(model, "import os", method="beam", num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="not both"):
        jaxdecode.generate(model, "x", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(GenerationConfigError, match="top_p"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(GenerationConfigError, match="beam sampling"):
        jaxdecode.generate(model, "x", generation_config=GenerationConfig(do_sample=True, num_beams=2))


def test_cli_chat_jsonl_prompt_ids_and_batch_stats_once(bos_model, tmp_path, capsys):
    from jaxdecode.cli import main
    d, hf, tok, stop_tok = bos_model
    conv = [{"role": "user", "content": "def add(a, b):"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    expected = _hf_greedy(hf, ids, N_NEW)
    assert main(["generate", "--model", str(d), "--chat", "--prompt", "def add(a, b):", "--max-new-tokens",
                 str(N_NEW), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["tokens"] == expected and list(lines[-1]) == ["batch_stats"] and len(lines) == 2
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in ({"messages": conv}, {"prompt": "multi\nline"},
                                                    {"ids": [5, 6, 7]})) + "\n")
    assert main(["generate", "--model", str(d), "--prompts-file", str(f), "--max-new-tokens", str(N_NEW),
                 "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["tokens"] == expected and lines[1]["prompt"] == "multi\nline" and lines[2]["prompt"] == [5, 6, 7]
    assert "seconds" in lines[-1]["batch_stats"] and "seconds" not in lines[0]["stats"]
    assert main(["generate", "--model", str(d), "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--stop", "\\n",
                 "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["prompt"] == [5, 6, 7]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    assert main(["generate", "--model", str(d), "--prompts-file", str(bad)]) == 2
    assert "exactly one of" in capsys.readouterr().err


def test_tokenizer_without_bos_matches_transformers(tiny_llama_dir):
    """A tokenizer that adds no special tokens (GPT-2 style): the prompt is its plain encoding."""
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    model = jaxdecode.load(tiny_llama_dir)
    ids = tok("def add(a, b):").input_ids
    assert ids == tok("def add(a, b):", add_special_tokens=False).input_ids
    r = jaxdecode.generate(model, "def add(a, b):", max_new_tokens=N_NEW, eos_ids=[])[0]
    assert r.prompt_tokens == ids and r.tokens == _hf_greedy(hf, ids, N_NEW, eos_token_id=None)


def test_config_values_a_method_cannot_apply_warn_and_transformers_configs_convert(bos_model):
    import transformers as tf
    model = jaxdecode.load(bos_model[0])
    cfg = GenerationConfig(repetition_penalty=1.3)
    with pytest.warns(UserWarning, match="repetition_penalty=1.3"):
        jaxdecode.generate(model, "import os", method="speculative", generation_config=cfg, max_new_tokens=3,
                           adaptive=False)
    a = jaxdecode.generate(model, "import os", generation_config=tf.GenerationConfig(repetition_penalty=1.3),
                           max_new_tokens=6, eos_ids=[])[0]
    b = jaxdecode.generate(model, "import os", repetition_penalty=1.3, max_new_tokens=6, eos_ids=[])[0]
    assert a.tokens == b.tokens
    with pytest.raises(TypeError, match="generation_config"):
        jaxdecode.generate(model, "import os", generation_config={"do_sample": True})
