"""hf_primal's benchmarks, each a module run from the repository root (``pip install -e ".[bench]"`` first)::

    python -m scripts.benchmarks.layers            # training-step time and memory vs SDPA / eager
    python -m scripts.benchmarks.peers             # against Performer, Nystromformer, Linformer; short inputs
    python -m scripts.benchmarks.generation        # GPT-2 decoding: latency and cache size
    python -m scripts.benchmarks.causal_lm         # GPT-2 language models trained from scratch on real text
    python -m scripts.benchmarks.long_documents    # long real documents trained from scratch (and its study:
    python -m scripts.benchmarks.long_documents_study)
    python -m scripts.benchmarks.conversion        # converting all-MiniLM-L6-v2, plenty of labels
    python -m scripts.benchmarks.conversion_tasks  # converting, small-label tasks, K layers
    python -m scripts.benchmarks.uncertainty       # KEP-SVGP calibration and out-of-distribution detection
    bash scripts/benchmarks/run_gpu.sh             # the timing benchmarks and the long-document table on one GPU

`harness` holds what they share (device and precision, timing, memory, worker processes, result tables);
`encoder` the BERT classifier of the timing benchmarks, `long_documents_task` the long-document task of the table
and its study, `minilm` the MiniLM pieces of the conversion benchmarks, `bbc_news` the data. No benchmark imports
another. Results (CSV, PNG, JSON) are written to ``results/`` beside them; docs/ quote them.
"""
