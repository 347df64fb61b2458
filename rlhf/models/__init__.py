"""Models: model folders, Hub ids and absent markers before anything loads (`folders`),
where models run and in what precision (`compute`), building the built-in tiny model and
tokenizer, loading and saving Hugging Face models (`loading`), batched generation
(`generation`), and merging candidates with mergekit or a greedy soup (`merging`)."""
