//! `.pt` conformance with Python (no torch: stub modules, `tests/py/pt_tool.py`): files we
//! write load with a torch.load-style unpickler, and a fixture laid out as torch.save writes it
//! (strided view, f16, int64, `_metadata` state, archive folder named after the file) reads
//! back with our reader. Skipped without POWERINFER_PYTHON (fails if CI is set).

use std::path::{Path, PathBuf};
use std::process::Command;

use powerinfer_predictor::pt::{self, PtObject, PtTensor};

fn python() -> Option<PathBuf> {
    match std::env::var_os("POWERINFER_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var_os("CI").is_some() => {
            panic!("POWERINFER_PYTHON must be set when CI is set")
        }
        None => {
            println!("skipped: POWERINFER_PYTHON not set");
            None
        }
    }
}

fn tool(py: &Path, mode: &str, file: &Path) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/pt_tool.py");
    let o = Command::new(py)
        .arg(script)
        .arg(mode)
        .arg(file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

/// The JSON `pt_tool.py` prints for `obj` (same field order and float formatting rules:
/// values as Python floats).
fn json_of(obj: &PtObject) -> String {
    fn t(x: &PtTensor) -> String {
        let dtype = match x.dtype() {
            pt::PtDtype::F32 => "float32",
            pt::PtDtype::F16 => "float16",
            pt::PtDtype::I64 => "int64",
            other => panic!("{other:?}"),
        };
        let shape: Vec<String> = x.shape().iter().map(|d| d.to_string()).collect();
        let values: Vec<String> = x.to_f64_vec().iter().map(|v| py_float(*v)).collect();
        format!(
            "{{\"shape\": [{}], \"dtype\": \"{dtype}\", \"values\": [{}]}}",
            shape.join(", "),
            values.join(", ")
        )
    }
    match obj {
        PtObject::Tensor(x) => format!("{{\"tensor\": {}}}", t(x)),
        PtObject::Dict(d) => {
            let items: Vec<String> = d
                .iter()
                .map(|(k, v)| format!("[\"{k}\", {}]", t(v)))
                .collect();
            format!("{{\"dict\": [{}]}}", items.join(", "))
        }
    }
}

/// Python's repr of a float (shortest round-trip, always with a `.` or exponent).
fn py_float(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        let s = format!("{v:?}");
        s
    }
}

#[test]
fn our_files_load_in_python_and_torch_layout_loads_here() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();

    let act = PtTensor::from_f32(vec![6], &[0.5, 0.0, 0.125, 1.0, 0.75, 0.25]).unwrap();
    let p = dir.path().join("activation_0.pt");
    pt::write_tensor(&p, &act).unwrap();
    assert_eq!(tool(&py, "read", &p), json_of(&PtObject::Tensor(act)));

    let sd = vec![
        (
            "fc1.weight".to_string(),
            PtTensor::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap(),
        ),
        (
            "fc2.weight".to_string(),
            PtTensor::from_f16(vec![3, 1], &[half::f16::from_f32(0.5); 3]).unwrap(),
        ),
    ];
    let p = dir.path().join("model_0.pt");
    pt::write_state_dict(&p, &sd).unwrap();
    assert_eq!(tool(&py, "read", &p), json_of(&PtObject::Dict(sd)));

    let p = dir.path().join("fixture.pt");
    let expect = tool(&py, "write", &p);
    let got = pt::read(&p).unwrap();
    assert_eq!(json_of(&got), expect);
    let PtObject::Dict(d) = got else { panic!() };
    assert_eq!(d[0].1.shape(), [2, 3]);
    assert_eq!(d[2].1.to_f64_vec()[3], (1u64 << 40) as f64);
}
