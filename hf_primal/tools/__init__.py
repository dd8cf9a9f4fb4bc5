"""What users run on models: `convert` (convert(): swap, then distillation or attention transfer, and the report),
`selection` (layer_sensitivity and the layer choice of convert(layers="auto")), `analysis` (attention spectra),
`embedding_metrics` (k-NN accuracy and neighbour overlap), `cli` and `demo` (the hf-primal command), `metrics`
(evaluate metric scripts that load offline), `data` (the demo's texts)."""
