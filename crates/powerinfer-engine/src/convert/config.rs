//! The fields of a Hugging Face `config.json` that the converter uses.

use serde_json::Value;

/// The model hyper-parameters, as convert.py's `Params.loadHFTransformerJson` reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// `model_type`: `llama` or `bamboo`.
    pub model_type: String,
    /// `vocab_size`.
    pub n_vocab: usize,
    /// `hidden_size`.
    pub n_embd: usize,
    /// `num_hidden_layers`.
    pub n_layer: usize,
    /// `max_sequence_length`, else `max_position_embeddings`.
    pub n_ctx: usize,
    /// `intermediate_size`.
    pub n_ff: usize,
    /// `num_attention_heads`.
    pub n_head: usize,
    /// `num_key_value_heads` (default `n_head`).
    pub n_head_kv: usize,
    /// `rms_norm_eps`.
    pub rms_eps: f64,
    /// `rope_theta`, if present.
    pub rope_theta: Option<f64>,
    /// `rope_scaling.factor` when `rope_scaling.type` is `linear`.
    pub rope_linear_factor: Option<f64>,
    /// `tie_word_embeddings` (default false).
    pub tie_word_embeddings: bool,
    /// `hidden_act` (`hidden_activation`), lower-cased, if present: `relu` for ReluLLaMA,
    /// `fatrelu` for ProSparse, `silu` for a plain LLaMA.
    pub hidden_act: Option<String>,
    /// `bos_token_id`, `eos_token_id`, `unk_token_id`, `sep_token_id`, `pad_token_id`, in that
    /// order (gguf-py `SpecialVocab`'s config.json source), where present and non-negative.
    pub special_ids: Vec<(&'static str, u32)>,
}

/// The special-token kinds of gguf-py's `SpecialVocab`, with their GGUF keys.
pub const SPECIAL_KINDS: [(&str, &str); 5] = [
    ("bos", "tokenizer.ggml.bos_token_id"),
    ("eos", "tokenizer.ggml.eos_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"),
    ("sep", "tokenizer.ggml.seperator_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"),
];

fn uint(v: &Value, key: &str) -> Result<usize, String> {
    match v.get(key) {
        Some(x) => x
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{key} must be a positive integer, got {x}")),
        None => Err(format!("missing {key}")),
    }
}

impl HfConfig {
    /// Parses `config.json` text. The error names the offending field.
    pub fn parse(text: &str) -> Result<HfConfig, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        if !v.is_object() {
            return Err("not a JSON object".into());
        }
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or("missing model_type")?
            .to_string();
        if model_type != "llama" && model_type != "bamboo" {
            return Err(format!(
                "model_type {model_type:?} is not supported (llama and bamboo are)"
            ));
        }
        let n_ctx = if v.get("max_sequence_length").is_some() {
            uint(&v, "max_sequence_length")?
        } else {
            uint(&v, "max_position_embeddings")?
        };
        let n_head = uint(&v, "num_attention_heads")?;
        let n_head_kv = if v.get("num_key_value_heads").is_some_and(|x| !x.is_null()) {
            uint(&v, "num_key_value_heads")?
        } else {
            n_head
        };
        let rms_eps = v
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .ok_or("missing or non-numeric rms_norm_eps")?;
        let rope_theta = match v.get("rope_theta") {
            None | Some(Value::Null) => None,
            Some(x) => Some(x.as_f64().ok_or("rope_theta must be a number")?),
        };
        let rope_linear_factor = match v.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(rs) => match rs.get("type").or_else(|| rs.get("rope_type")) {
                None | Some(Value::Null) => None,
                Some(t) if t.as_str() == Some("linear") => Some(
                    rs.get("factor")
                        .and_then(Value::as_f64)
                        .ok_or("rope_scaling.factor must be a number")?,
                ),
                Some(t) => return Err(format!("rope_scaling type {t} is not supported")),
            },
        };
        let tie_word_embeddings = v
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let hidden_act = match v.get("hidden_act").or_else(|| v.get("hidden_activation")) {
            None | Some(Value::Null) => None,
            Some(x) => Some(
                x.as_str()
                    .ok_or("hidden_act must be a string")?
                    .to_ascii_lowercase(),
            ),
        };
        let special_ids = SPECIAL_KINDS
            .iter()
            .filter_map(|(kind, _)| {
                let id = v.get(format!("{kind}_token_id"))?.as_u64()?;
                Some((*kind, u32::try_from(id).ok()?))
            })
            .collect();
        let c = HfConfig {
            model_type,
            n_vocab: uint(&v, "vocab_size")?,
            n_embd: uint(&v, "hidden_size")?,
            n_layer: uint(&v, "num_hidden_layers")?,
            n_ctx,
            n_ff: uint(&v, "intermediate_size")?,
            n_head,
            n_head_kv,
            rms_eps,
            rope_theta,
            rope_linear_factor,
            tie_word_embeddings,
            hidden_act,
            special_ids,
        };
        if c.n_embd % c.n_head != 0 || (c.n_embd / c.n_head) % 2 != 0 {
            return Err(format!(
                "hidden_size {} is not num_attention_heads {} times an even head size",
                c.n_embd, c.n_head
            ));
        }
        if c.n_head % c.n_head_kv != 0 {
            return Err(format!(
                "num_key_value_heads {} does not divide num_attention_heads {}",
                c.n_head_kv, c.n_head
            ));
        }
        Ok(c)
    }

    /// Head size.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Whether `hidden_act` names a ReLU (`relu`, or ProSparse's `fatrelu`, whose shifted
    /// threshold neither PowerInfer nor this engine applies).
    pub fn is_relu(&self) -> bool {
        matches!(self.hidden_act.as_deref(), Some("relu" | "fatrelu"))
    }

    /// Key/value width.
    pub fn n_embd_kv(&self) -> usize {
        self.head_dim() * self.n_head_kv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_and_rejects_bad_ones() {
        let c = HfConfig::parse(
            r#"{"model_type":"bamboo","vocab_size":10,"hidden_size":64,"num_hidden_layers":2,
            "max_position_embeddings":128,"intermediate_size":256,"num_attention_heads":4,
            "rms_norm_eps":1e-6,"rope_theta":10000.0,"rope_scaling":{"type":"linear","factor":2.0},
            "bos_token_id":1,"eos_token_id":2,"pad_token_id":-1}"#,
        )
        .unwrap();
        assert_eq!(c.n_head_kv, 4);
        assert_eq!(c.rope_linear_factor, Some(2.0));
        assert_eq!(c.special_ids, [("bos", 1), ("eos", 2)]);
        assert_eq!(c.hidden_act, None);
        assert!(!c.is_relu());
        let relu = HfConfig::parse(
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":64,"num_hidden_layers":2,
            "max_position_embeddings":128,"intermediate_size":256,"num_attention_heads":4,
            "rms_norm_eps":1e-6,"hidden_act":"ReLU"}"#,
        )
        .unwrap();
        assert!(relu.is_relu());
        assert!(HfConfig::parse(
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":64,"num_hidden_layers":2,
            "max_position_embeddings":128,"intermediate_size":256,"num_attention_heads":4,
            "rms_norm_eps":1e-6,"hidden_act":3}"#,
        )
        .unwrap_err()
        .contains("hidden_act"));
        assert!(HfConfig::parse(r#"{"model_type":"gpt2"}"#)
            .unwrap_err()
            .contains("gpt2"));
        assert!(HfConfig::parse(r#"{"model_type":"llama","vocab_size":10}"#)
            .unwrap_err()
            .contains("max_position_embeddings"));
    }
}
