"""channels_last for training loops outside Lightning: the Hugging Face ``Trainer`` and Accelerate.

* ``cltrain.integrations.transformers``: ``ChannelsLastCallback``, a ``transformers.TrainerCallback``
  (``Trainer(..., callbacks=[ChannelsLastCallback()])``);
* ``cltrain.integrations.accelerate``: ``prepare_channels_last(model, accelerator)``, called before
  ``accelerator.prepare``;
* ``cltrain.integrations.inputs_hook``: ``ChannelsLastInputs``, the forward pre-hook both use: it puts the
  model's image arguments in the model's layout and checks the first batch, for loops whose batches a
  plug-in cannot change.

Nothing is imported here: ``import cltrain`` never imports transformers or accelerate. Install them with
``pip install cltrain[hf]``. The guide: docs/guides/huggingface.md.
"""

__all__: list[str] = []
