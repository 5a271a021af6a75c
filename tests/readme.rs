//! The README's and the `docs/` pages' examples, run as written against the demo: every
//! `curl` in a `sh` block that names `127.0.0.1:8000` (the demo's address; the demo here
//! listens on a free port, put in its place) must succeed.

mod common;

use std::process::Command;

/// The README's `sh` blocks, as commands: continuation lines joined, comments dropped.
fn shell_commands(readme: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut rest = readme;
    while let Some(start) = rest.find("```sh\n") {
        let body = &rest[start + 6..];
        let end = body.find("```").expect("an unclosed sh block");
        let joined = body[..end].replace("\\\n", " ");
        for line in joined.lines() {
            let line = line.trim();
            if !line.is_empty() && !line.starts_with('#') {
                commands.push(line.to_string());
            }
        }
        rest = &body[end + 3..];
    }
    commands
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_examples_run_against_the_demo() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut pages: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    // The README first: it sets TOKEN for the demo.
    pages.insert(0, root.join("README.md"));
    let readme: String = pages
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let examples: Vec<String> = shell_commands(&readme)
        .into_iter()
        .filter(|c| c.starts_with("curl ") && c.contains("127.0.0.1:8000"))
        .collect();
    // 8 in the README's tour, 8 in docs/policies.md, as of writing: fewer means a page
    // went unread.
    assert!(examples.len() >= 16, "{examples:#?}");
    let token = readme
        .lines()
        .find_map(|l| l.strip_prefix("TOKEN="))
        .and_then(|l| l.split_whitespace().next())
        .expect("the README sets TOKEN for the demo");

    let port = common::procs::free_port();
    let listen = format!("127.0.0.1:{port}");
    let _demo = common::procs::switchyard(&["demo", "--listen", &listen]);
    common::procs::wait_ok(&format!("http://{listen}/ready")).await;
    // The swap examples upload `session_affinity.wasm` from the working directory.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        common::guest("session_affinity"),
        dir.path().join("session_affinity.wasm"),
    )
    .unwrap();

    for example in &examples {
        // Fail on an HTTP error status, and say why.
        let command = example
            .replacen("curl ", "curl --fail-with-body -sS ", 1)
            .replace("127.0.0.1:8000", &listen);
        let out = tokio::task::spawn_blocking({
            let (command, dir) = (command.clone(), dir.path().to_path_buf());
            let token = token.to_string();
            move || {
                Command::new("sh")
                    .args(["-c", &command])
                    .current_dir(dir)
                    .env("TOKEN", token)
                    .output()
                    .expect("sh and curl run (tools/test.sh installs curl)")
            }
        })
        .await
        .unwrap();
        assert!(
            out.status.success(),
            "README example failed: {example}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
