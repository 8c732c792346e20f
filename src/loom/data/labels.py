"""The label that marks a position as not to be predicted (padding, a document's first token
under --doc-mask, a prompt's tokens in chat fine-tuning). The data writes it and every loss
skips it; it lives here, below `loom.losses`, because the data produces it."""

IGNORE_INDEX = -100  # torch's cross_entropy default ignore_index
