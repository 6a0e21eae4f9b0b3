//! Conventions of model files that their writers and readers share beyond the container:
//! numbers a converter, a generator and an engine must agree on to read the same file alike.

/// OPT's learned position embeddings (`position_embd.weight`) start with two rows of padding
/// (Hugging Face's `OPTLearnedPositionalEmbedding` offset): position `p` reads row `p + 2`, so
/// a table of `n` rows serves a context of `n - 2` positions.
pub const OPT_POSITION_OFFSET: usize = 2;
