//! `/metrics` read by a real Prometheus text parser: the official Python client's
//! (`prometheus_client.parser`), so that what the router exposes is checked against a
//! parser it does not share code with.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

/// One sample: its name, labels, value, and its family's declared type.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
    pub kind: String,
}

const PARSER: &str = r#"
import json, math, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        v = s.value if math.isfinite(s.value) else None
        out.append([s.name, s.labels, v, family.type])
print(json.dumps(out))
"#;

/// What the parser prints per sample: name, labels, value (null if not finite), type.
type Row = (String, BTreeMap<String, String>, Option<f64>, String);

/// Parses `text`; panics with the parser's own message if it is not valid exposition.
pub fn parse(text: &str) -> Vec<Sample> {
    let mut child = Command::new("python3")
        .args(["-c", PARSER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs (tools/test.sh installs it and prometheus_client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "/metrics is not valid Prometheus text: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Row> = serde_json::from_slice(&out.stdout).unwrap();
    rows.into_iter()
        .map(|(name, labels, value, kind)| Sample {
            name,
            labels,
            value: value.unwrap_or(f64::NAN),
            kind,
        })
        .collect()
}

/// The counters among `samples`, keyed by name and labels.
pub fn counters(samples: &[Sample]) -> BTreeMap<String, f64> {
    samples
        .iter()
        .filter(|s| s.kind == "counter" || s.kind == "histogram" && !s.name.ends_with("_bucket"))
        .map(|s| (format!("{}{:?}", s.name, s.labels), s.value))
        .collect()
}
