//! Chat templates rendered by our Jinja engine against Hugging Face's renderer (jinja2 set up as
//! `apply_chat_template` sets it up): `tests/data/chat/golden.json`, made by
//! `tests/py/chat_golden.py` from `tests/data/chat/templates.json` (real templates of Hugging Face
//! models, as llama.cpp's test-chat-template.cpp carries them, and our named templates).

use std::path::Path;

use powerinfer_engine::{ChatMessage, ChatTemplate};
use serde_json::Value;

fn load(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/chat")
        .join(name);
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

#[test]
fn templates_render_as_hugging_face_does() {
    let templates = load("templates.json");
    let golden = load("golden.json");
    let mut checked = 0;
    for case in golden["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let t = templates
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap();
        let source = t["template"].as_str().unwrap();
        if let Some(named) = name.strip_prefix("named:") {
            assert_eq!(ChatTemplate::named(named), Some(source), "{named} drifted");
        }
        let tmpl = ChatTemplate::new(
            source,
            t["bos"].as_str().unwrap(),
            t["eos"].as_str().unwrap(),
        )
        .unwrap();
        let conv = &golden["conversations"][case["conversation"].as_str().unwrap()];
        let messages: Vec<ChatMessage> = conv
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let got = tmpl.render(&messages, agp);
        let what = format!("{name} / {} / agp {agp}", case["conversation"]);
        match (&got, case.get("output"), case.get("error")) {
            (Ok(text), Some(want), None) => assert_eq!(text, want.as_str().unwrap(), "{what}"),
            (Err(e), None, Some(msg)) => {
                let msg = msg.as_str().unwrap();
                assert!(e.to_string().contains(msg), "{what}: {e} should say {msg}");
            }
            _ => panic!("{what}: got {got:?}, want {case}"),
        }
        checked += 1;
    }
    assert!(checked >= 60, "{checked} cases");
    // Every named template is in the golden set.
    for n in ChatTemplate::names() {
        assert!(
            templates
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["name"] == format!("named:{n}")),
            "{n} has no golden cases"
        );
    }
}
