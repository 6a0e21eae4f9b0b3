//! The fields of a Hugging Face `config.json` that the converter uses.

use serde_json::Value;

/// The model family a checkpoint converts to (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArch {
    /// `llama` (ReluLLaMA, ProSparse): convert.py's path.
    Llama,
    /// `bamboo` (`model_type` `bamboo`): convert.py's path.
    Bamboo,
    /// `falcon` (ReluFalcon): PowerInfer's `convert-hf-to-powerinfer-gguf.py` path.
    Falcon,
    /// `opt`: PowerInfer's `convert-hf-to-powerinfer-gguf.py` path.
    Opt,
}

impl HfArch {
    /// The `general.architecture` value.
    pub fn name(self) -> &'static str {
        match self {
            HfArch::Llama => "llama",
            HfArch::Bamboo => "bamboo",
            HfArch::Falcon => "falcon",
            HfArch::Opt => "opt",
        }
    }

    /// Whether PowerInfer converts this family with `convert-hf-to-powerinfer-gguf.py`
    /// (predictor tensors first, byte-level BPE vocabulary) rather than `convert.py`.
    pub fn hf_script(self) -> bool {
        matches!(self, HfArch::Falcon | HfArch::Opt)
    }
}

/// The model hyper-parameters: for `llama`/`bamboo` as convert.py's
/// `Params.loadHFTransformerJson` reads them, for `falcon`/`opt` as PowerInfer's
/// `convert-hf-to-powerinfer-gguf.py` does (`FalconModel` / `OptModel`).
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The family: from `model_type` (`llama`, `bamboo`, `falcon`, `RefinedWeb`,
    /// `RefinedWebModel`, `opt`), else from `architectures[0]` (`FalconForCausalLM`,
    /// `RWForCausalLM`, `OPTForCausalLM`).
    pub arch: HfArch,
    /// `vocab_size`.
    pub n_vocab: usize,
    /// `hidden_size`.
    pub n_embd: usize,
    /// `num_hidden_layers` (Falcon's old configs: `n_layer`).
    pub n_layer: usize,
    /// The `{arch}.context_length` written: `max_sequence_length`, else
    /// `max_position_embeddings` (llama, bamboo); 2048 (falcon, hard-coded by PowerInfer's
    /// script); `max_position_embeddings + 2`, the rows of `embed_positions` (opt; PowerInfer's
    /// script hard-codes 2050, which is this for every released OPT model, and its loader
    /// requires `position_embd` to have exactly `context_length` rows).
    pub n_ctx: usize,
    /// `intermediate_size` (llama, bamboo); `4 · hidden_size` (falcon); `ffn_dim` (opt).
    pub n_ff: usize,
    /// `num_attention_heads` (Falcon's old configs: `n_head`).
    pub n_head: usize,
    /// `num_key_value_heads` (default `n_head`; llama, bamboo); `num_kv_heads`, else
    /// `n_head_kv`, else 1 (falcon); `n_head` (opt).
    pub n_head_kv: usize,
    /// The norm epsilon written: `rms_norm_eps` (llama, bamboo), `layer_norm_epsilon`
    /// (falcon); unused for opt (PowerInfer's script writes none; the engine defaults to 1e-5,
    /// Hugging Face's OPT value).
    pub rms_eps: f64,
    /// `rope_theta`, if present (llama, bamboo).
    pub rope_theta: Option<f64>,
    /// `rope_scaling.factor` when `rope_scaling.type` is `linear` (llama, bamboo).
    pub rope_linear_factor: Option<f64>,
    /// `tie_word_embeddings`: default false for llama/bamboo; default true for falcon (a
    /// falcon checkpoint without `lm_head.weight` then gets the token embedding as its head);
    /// opt requires true.
    pub tie_word_embeddings: bool,
    /// The FFN activation, lower-cased, if the config names one: `hidden_act`
    /// (`hidden_activation`) for llama/bamboo (`relu` for ReluLLaMA, `fatrelu` for ProSparse,
    /// `silu` for a plain LLaMA); `activation` (falcon) and `activation_function` (opt) are
    /// checked to be `relu` when parsing.
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

/// `key`, if present and not null, as a bool.
fn opt_bool(v: &Value, key: &str) -> Result<Option<bool>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| format!("{key} must be true or false, got {x}")),
    }
}

/// `key`, if present and not null, as a string.
fn opt_str<'a>(v: &'a Value, key: &str) -> Result<Option<&'a str>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_str()
            .map(Some)
            .ok_or_else(|| format!("{key} must be a string, got {x}")),
    }
}

/// The first of `keys` that is present and not null, as a positive integer.
fn uint_any(v: &Value, keys: &[&str]) -> Result<Option<usize>, String> {
    match keys
        .iter()
        .find(|k| v.get(**k).is_some_and(|x| !x.is_null()))
    {
        Some(k) => uint(v, k).map(Some),
        None => Ok(None),
    }
}

/// The special ids of `config.json` (see [`HfConfig::special_ids`]).
fn special_ids(v: &Value) -> Vec<(&'static str, u32)> {
    SPECIAL_KINDS
        .iter()
        .filter_map(|(kind, _)| {
            let id = v.get(format!("{kind}_token_id"))?.as_u64()?;
            Some((*kind, u32::try_from(id).ok()?))
        })
        .collect()
}

/// The family of a config: `model_type` first (convert.py's own test), then
/// `architectures[0]` (the test of PowerInfer's HF script); the two must not disagree.
fn family(v: &Value) -> Result<HfArch, String> {
    let model_type = opt_str(v, "model_type")?;
    let first_arch = match v.get("architectures") {
        None | Some(Value::Null) => None,
        Some(a) => match a.as_array().map(|a| a.first()) {
            Some(None) => None,
            Some(Some(Value::String(s))) => Some(s.as_str()),
            _ => return Err("architectures must be a list of strings".into()),
        },
    };
    let by_type = match model_type {
        None => None,
        Some("llama") => Some(HfArch::Llama),
        Some("bamboo") => Some(HfArch::Bamboo),
        Some("falcon" | "RefinedWeb" | "RefinedWebModel") => Some(HfArch::Falcon),
        Some("opt") => Some(HfArch::Opt),
        Some(t) => {
            return Err(format!(
                "model_type {t:?} is not supported (llama, bamboo, falcon, opt are)"
            ))
        }
    };
    let by_arch = match first_arch {
        Some("FalconForCausalLM" | "RWForCausalLM") => Some(HfArch::Falcon),
        Some("OPTForCausalLM") => Some(HfArch::Opt),
        Some("LlamaForCausalLM") => Some(HfArch::Llama),
        _ => None,
    };
    match (by_type, by_arch) {
        // convert.py converts any llama/bamboo model_type itself, whatever the class.
        (Some(t @ (HfArch::Llama | HfArch::Bamboo)), Some(HfArch::Llama) | None) => Ok(t),
        (Some(t), Some(a)) if t == a => Ok(t),
        (Some(t), None) => Ok(t),
        (Some(_), Some(_)) => Err(format!(
            "model_type {:?} does not match architectures[0] {:?}",
            model_type.unwrap_or_default(),
            first_arch.unwrap_or_default(),
        )),
        (None, Some(a @ (HfArch::Falcon | HfArch::Opt))) => Ok(a),
        (None, _) => Err(match first_arch {
            Some(a) => format!(
                "missing model_type, and architectures[0] {a:?} is not supported \
                 (FalconForCausalLM, RWForCausalLM, OPTForCausalLM are)"
            ),
            None => "missing model_type".into(),
        }),
    }
}

impl HfConfig {
    /// Parses `config.json` text. The error names the offending field.
    pub fn parse(text: &str) -> Result<HfConfig, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        if !v.is_object() {
            return Err("not a JSON object".into());
        }
        match family(&v)? {
            arch @ (HfArch::Llama | HfArch::Bamboo) => HfConfig::parse_llama(&v, arch),
            HfArch::Falcon => HfConfig::parse_falcon(&v),
            HfArch::Opt => HfConfig::parse_opt(&v),
        }
    }

    fn parse_llama(v: &Value, arch: HfArch) -> Result<HfConfig, String> {
        let n_ctx = if v.get("max_sequence_length").is_some() {
            uint(v, "max_sequence_length")?
        } else {
            uint(v, "max_position_embeddings")?
        };
        let n_head = uint(v, "num_attention_heads")?;
        let n_head_kv = if v.get("num_key_value_heads").is_some_and(|x| !x.is_null()) {
            uint(v, "num_key_value_heads")?
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
        let special_ids = special_ids(v);
        let c = HfConfig {
            arch,
            n_vocab: uint(v, "vocab_size")?,
            n_embd: uint(v, "hidden_size")?,
            n_layer: uint(v, "num_hidden_layers")?,
            n_ctx,
            n_ff: uint(v, "intermediate_size")?,
            n_head,
            n_head_kv,
            rms_eps,
            rope_theta,
            rope_linear_factor,
            tie_word_embeddings,
            hidden_act,
            special_ids,
        };
        c.check_heads("num_key_value_heads")?;
        Ok(c)
    }

    /// Falcon as PowerInfer's `FalconModel` reads it, plus refusals of the variants its
    /// `falcon` graph cannot run (ALiBi, sequential attention/FFN, biases, a non-ReLU
    /// activation) and of a multi-head K/V layout whose head count the script would guess
    /// wrong.
    fn parse_falcon(v: &Value) -> Result<HfConfig, String> {
        let n_layer = uint_any(v, &["num_hidden_layers", "n_layer"])?
            .ok_or("missing num_hidden_layers (or n_layer)")?;
        let n_head = uint_any(v, &["num_attention_heads", "n_head"])?
            .ok_or("missing num_attention_heads (or n_head)")?;
        let kv = uint_any(v, &["num_kv_heads", "n_head_kv"])?;
        let n_embd = uint(v, "hidden_size")?;
        let eps = v
            .get("layer_norm_epsilon")
            .and_then(Value::as_f64)
            .ok_or("missing or non-numeric layer_norm_epsilon")?;
        if opt_bool(v, "alibi")? == Some(true) {
            return Err(
                "alibi is true: ALiBi Falcon models (falcon-rw) are not supported; PowerInfer's \
                 falcon graph uses rotary positions"
                    .into(),
            );
        }
        if opt_bool(v, "bias")? == Some(true) {
            return Err(
                "bias is true: PowerInfer's falcon graph has no linear-layer biases".into(),
            );
        }
        let new_arch = opt_bool(v, "new_decoder_architecture")?.unwrap_or(false);
        if !new_arch && opt_bool(v, "parallel_attn")? == Some(false) {
            return Err(
                "parallel_attn is false: PowerInfer's falcon graph runs attention and FFN in \
                 parallel"
                    .into(),
            );
        }
        if !new_arch && kv.is_none() && opt_bool(v, "multi_query")? == Some(false) {
            return Err(
                "multi_query is false and no num_kv_heads: the fused QKV would be read with one \
                 K/V head (PowerInfer's default), which this layout does not have"
                    .into(),
            );
        }
        if let Some(act) = opt_str(v, "activation")? {
            if !act.eq_ignore_ascii_case("relu") {
                return Err(format!(
                    "activation {act:?}: PowerInfer's falcon graph runs its FFN with ReLU"
                ));
            }
        }
        let c = HfConfig {
            arch: HfArch::Falcon,
            n_vocab: uint(v, "vocab_size")?,
            n_embd,
            n_layer,
            n_ctx: 2048,
            n_ff: n_embd
                .checked_mul(4)
                .ok_or_else(|| format!("hidden_size {n_embd} is too large"))?,
            n_head,
            n_head_kv: kv.unwrap_or(1),
            rms_eps: eps,
            rope_theta: None,
            rope_linear_factor: None,
            tie_word_embeddings: opt_bool(v, "tie_word_embeddings")?.unwrap_or(true),
            hidden_act: Some("relu".into()),
            special_ids: special_ids(v),
        };
        c.check_heads("num_kv_heads")?;
        Ok(c)
    }

    /// OPT as PowerInfer's `OptModel` reads it, plus refusals of the variants its `opt` graph
    /// cannot run (post-norm OPT-350m, projected embeddings, no biases, untied head, a non-ReLU
    /// activation).
    fn parse_opt(v: &Value) -> Result<HfConfig, String> {
        let n_embd = uint(v, "hidden_size")?;
        if opt_bool(v, "do_layer_norm_before")? == Some(false) {
            return Err(
                "do_layer_norm_before is false: post-norm OPT (opt-350m) is not supported; \
                 PowerInfer's opt graph normalizes before attention and FFN"
                    .into(),
            );
        }
        if let Some(p) = uint_any(v, &["word_embed_proj_dim"])? {
            if p != n_embd {
                return Err(format!(
                    "word_embed_proj_dim {p} differs from hidden_size {n_embd}: projected \
                     embeddings (project_in/project_out) are not supported"
                ));
            }
        }
        for key in ["enable_bias", "layer_norm_elementwise_affine"] {
            if opt_bool(v, key)? == Some(false) {
                return Err(format!(
                    "{key} is false: PowerInfer's opt graph needs every bias and norm weight"
                ));
            }
        }
        if opt_bool(v, "tie_word_embeddings")? == Some(false) {
            return Err(
                "tie_word_embeddings is false: PowerInfer's opt graph reads the head from the \
                 token embeddings"
                    .into(),
            );
        }
        if let Some(act) = opt_str(v, "activation_function")? {
            if !act.eq_ignore_ascii_case("relu") {
                return Err(format!(
                    "activation_function {act:?}: PowerInfer's opt graph runs its FFN with ReLU"
                ));
            }
        }
        let n_pos = uint(v, "max_position_embeddings")?;
        let n_head = uint(v, "num_attention_heads")?;
        let c = HfConfig {
            arch: HfArch::Opt,
            n_vocab: uint(v, "vocab_size")?,
            n_embd,
            n_layer: uint(v, "num_hidden_layers")?,
            n_ctx: n_pos
                .checked_add(2)
                .ok_or_else(|| format!("max_position_embeddings {n_pos} is too large"))?,
            n_ff: uint(v, "ffn_dim")?,
            n_head,
            n_head_kv: n_head,
            rms_eps: 1e-5,
            rope_theta: None,
            rope_linear_factor: None,
            tie_word_embeddings: true,
            hidden_act: Some("relu".into()),
            special_ids: special_ids(v),
        };
        c.check_heads("num_attention_heads")?;
        Ok(c)
    }

    /// `hidden_size` = heads × an even head size, and `kv_key`'s head count divides the query
    /// heads.
    fn check_heads(&self, kv_key: &str) -> Result<(), String> {
        if self.n_embd % self.n_head != 0 || (self.n_embd / self.n_head) % 2 != 0 {
            return Err(format!(
                "hidden_size {} is not num_attention_heads {} times an even head size",
                self.n_embd, self.n_head
            ));
        }
        if self.n_head % self.n_head_kv != 0 {
            return Err(format!(
                "{kv_key} {} does not divide num_attention_heads {}",
                self.n_head_kv, self.n_head
            ));
        }
        Ok(())
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

    #[test]
    fn falcon_and_opt_families() {
        // Old RW keys: n_layer, n_head, no K/V head count (one).
        let rw = HfConfig::parse(
            r#"{"architectures":["RWForCausalLM"],"model_type":"RefinedWebModel","n_layer":3,
            "n_head":4,"hidden_size":64,"layer_norm_epsilon":1e-5,"vocab_size":10,
            "multi_query":true,"bos_token_id":7}"#,
        )
        .unwrap();
        assert_eq!(rw.arch, HfArch::Falcon);
        assert_eq!((rw.n_layer, rw.n_head, rw.n_head_kv), (3, 4, 1));
        assert_eq!((rw.n_ff, rw.n_ctx), (256, 2048));
        assert_eq!(rw.special_ids, [("bos", 7)]);
        // New keys, and the family from architectures alone.
        let f40 = HfConfig::parse(
            r#"{"architectures":["FalconForCausalLM"],"num_hidden_layers":2,
            "num_attention_heads":8,"num_kv_heads":2,"hidden_size":64,
            "layer_norm_epsilon":1e-5,"vocab_size":10,"new_decoder_architecture":true}"#,
        )
        .unwrap();
        assert_eq!((f40.arch, f40.n_head_kv), (HfArch::Falcon, 2));
        let opt = HfConfig::parse(
            r#"{"architectures":["OPTForCausalLM"],"model_type":"opt","hidden_size":64,
            "ffn_dim":96,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":10,
            "max_position_embeddings":2048}"#,
        )
        .unwrap();
        assert_eq!(opt.arch, HfArch::Opt);
        assert_eq!((opt.n_ff, opt.n_ctx, opt.n_head_kv), (96, 2050, 4));
        // Disagreeing families, unknown classes.
        assert!(
            HfConfig::parse(r#"{"model_type":"opt","architectures":["RWForCausalLM"]}"#)
                .unwrap_err()
                .contains("does not match")
        );
        assert!(HfConfig::parse(r#"{"architectures":["GPT2LMHeadModel"]}"#)
            .unwrap_err()
            .contains("GPT2LMHeadModel"));
    }
}
