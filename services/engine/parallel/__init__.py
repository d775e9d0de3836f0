"""The engine's parallel layers: rank groups, tensor-parallel linears, the vocabulary-parallel
embedding and LM head (log-probs, top-n and sampling without gathering a row's logits), and
expert-parallel MoE dispatch/combine. docs/parallel.md describes the layout they implement."""
