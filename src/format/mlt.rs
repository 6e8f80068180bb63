//! MLT1 tokenizer files (placeholder: owned by the tokenizer work).
