"""One request's generation loop: plan, prompt, decode steps, delay pattern, sampling, the codec,
streaming, chunked codec; many requests at once are :mod:`higgs_pack.runtime.engine`'s."""
