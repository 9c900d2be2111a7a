"""`kiln bench`: a load generator for LLM servers and for artifacts run in-process.

Seeded workloads (workloads.py) rendered into real text (text.py), issued closed-loop or as
Poisson arrivals (loadgen.py, which the serving tests drive too) against a target (target_http.py,
target_openai.py, target_engine.py, target_hf.py), timed client-side (records.py), summarised per
level (stats.py) next to what the server's /metrics said (scrape.py, observe.py), printed
(report.py), plotted (plots.py) and compared side by side with HF transformers (compare.py).
"""
