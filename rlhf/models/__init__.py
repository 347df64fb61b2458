"""Models: building the built-in tiny model and tokenizer, loading and saving local Hugging
Face models (`loading`), batched generation (`generation`), and merging candidates with
mergekit or a greedy soup (`merging`)."""
