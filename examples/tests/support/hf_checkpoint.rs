//! Pieces of a tiny Hugging Face LLaMA checkpoint for conversion tests, shared by
//! `examples/tests/convert.rs` and `examples/tests/predictor_convert.rs` (each
//! includes this file with `#[path]`): a SentencePiece `tokenizer.model` written with a small
//! protobuf writer, and the checkpoint's tensor names and torch shapes.

/// Appends `v` as a protobuf varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// Appends a length-delimited protobuf field.
fn len_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A SentencePiece model proto holding `pieces` (piece, score, SentencePiece type; type 1,
/// NORMAL, is the default and not written), a trainer spec (model type BPE, unk 0, bos 1,
/// eos 2) and a normalizer spec with `add_dummy_prefix`.
pub fn tokenizer_model(pieces: &[(String, f32, u64)]) -> Vec<u8> {
    let mut m = Vec::new();
    for (p, s, t) in pieces {
        let mut piece = Vec::new();
        len_field(&mut piece, 1, p.as_bytes());
        piece.push(2 << 3 | 5);
        piece.extend(s.to_le_bytes());
        if *t != 1 {
            varint(&mut piece, 3 << 3);
            varint(&mut piece, *t);
        }
        len_field(&mut m, 1, &piece);
    }
    // trainer_spec { model_type: BPE(2) = field 3, unk_id 0, bos_id 1, eos_id 2 }
    let mut trainer = Vec::new();
    for (f, v) in [(3u64, 2u64), (40, 0), (41, 1), (42, 2)] {
        varint(&mut trainer, f << 3);
        varint(&mut trainer, v);
    }
    len_field(&mut m, 2, &trainer);
    // normalizer_spec { add_dummy_prefix: true = field 3 }
    len_field(&mut m, 3, &[3 << 3, 1]);
    m
}

/// Sizes of the test checkpoint.
pub struct LlamaDims {
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ff: usize,
    pub n_layer: usize,
}

/// The tensor names and torch shapes of a LLaMA checkpoint in file order: embeddings, final
/// norm, output head, then per layer the norms, attention and MLP weights (with
/// `self_attn.rotary_emb.inv_freq` after `o_proj` when `inv_freq`, as older checkpoints have).
pub fn llama_tensor_specs(d: &LlamaDims, inv_freq: bool) -> Vec<(String, Vec<usize>)> {
    let kv = d.n_embd / d.n_head * d.n_head_kv;
    let mut specs: Vec<(String, Vec<usize>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![d.n_vocab, d.n_embd],
        ),
        ("model.norm.weight".into(), vec![d.n_embd]),
        ("lm_head.weight".into(), vec![d.n_vocab, d.n_embd]),
    ];
    for l in 0..d.n_layer {
        let mut layer = vec![
            ("input_layernorm.weight", vec![d.n_embd]),
            ("self_attn.q_proj.weight", vec![d.n_embd, d.n_embd]),
            ("self_attn.k_proj.weight", vec![kv, d.n_embd]),
            ("self_attn.v_proj.weight", vec![kv, d.n_embd]),
            ("self_attn.o_proj.weight", vec![d.n_embd, d.n_embd]),
        ];
        if inv_freq {
            layer.push((
                "self_attn.rotary_emb.inv_freq",
                vec![d.n_embd / d.n_head / 2],
            ));
        }
        layer.extend([
            ("post_attention_layernorm.weight", vec![d.n_embd]),
            ("mlp.gate_proj.weight", vec![d.n_ff, d.n_embd]),
            ("mlp.up_proj.weight", vec![d.n_ff, d.n_embd]),
            ("mlp.down_proj.weight", vec![d.n_embd, d.n_ff]),
        ]);
        specs.extend(
            layer
                .into_iter()
                .map(|(n, s)| (format!("model.layers.{l}.{n}"), s)),
        );
    }
    specs
}
