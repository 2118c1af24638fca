"""Per-step mask cost of the regex / JSON-schema automaton constraint, both mask forms (the packed bitmask
row and the class-table gather), batch 1 and 16:  python benchmarks/bench_mask_forms.py"""
import time, jax, jax.numpy as jnp, numpy as np, jaxdecode
from jaxdecode.constraints import automaton as am
m = jaxdecode.load(); tok = m.tokenizer; v = m.config.vocab_size
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
for spec in (r"[0-9]{1,3}", schema):
    a = am.compile_json_schema(spec, tok, vocab_size=v, eos_ids=(0,)) if isinstance(spec, dict) else \
        am.compile_regex(spec, tok, vocab_size=v, eos_ids=(0,))
    for form in ("classes", "bits"):
        c = a.constraint(mask=form).prepare(v, (0,))
        for b in (1, 16):
            st = am.AutomatonState(node=(jnp.asarray(np.random.default_rng(0).integers(0, a.num_states, b), jnp.int32),))
            f = jax.jit(lambda c, s: c.allowed(s, v))
            f(c, st).block_until_ready()
            t = time.perf_counter(); n = 200
            for _ in range(n):
                out = f(c, st)
            out.block_until_ready()
            print(f"{str(spec)[:24]:24s} S={a.num_states:4d} C={a.num_classes:3d} auto={a.mask_form():7s} "
                  f"form={form:7s} batch={b:2d}: {1e6 * (time.perf_counter() - t) / n:8.1f} us/step")
