"""The generation loop: prompt, decode steps, delay pattern, sampling, streaming, chunked codec."""
