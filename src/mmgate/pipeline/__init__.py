"""The request pipeline: plan -> render/tokenize -> fetch/decode -> preprocess -> expand -> PreparedRequest.

``planning.py`` (refuse early, from the request alone: models, modalities, counts, schemes, anchors),
``prepare.py`` (:class:`~mmgate.pipeline.prepare.Pipeline`: one engine-neutral PreparedRequest per
request), ``runtime.py`` (the served model: bundle, tokenizer, family), ``cache.py`` (the
preprocessed-item cache, by content hash), ``budget.py`` (the in-flight byte budget) and ``memory.py``
(the allocator settings and the idle trim the budget and the body reader hold).
"""
