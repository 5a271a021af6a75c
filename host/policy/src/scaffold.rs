//! `switchyard policy new`: a ready-to-build policy project, with the contract's WIT, the
//! build recipe (versions, features, flags), sample test cases and a README.

use std::path::{Path, PathBuf};

/// The contract every scaffold carries.
const WIT: &str = include_str!("../../../wit/policy.wit");

/// Languages a scaffold can be made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// Rust with wit-bindgen (`cargo build --release --target wasm32-wasip2`).
    Rust,
    /// Python with componentize-py (`./build.sh`).
    Python,
    /// JavaScript with componentize-js (`npm install && npm run build`).
    Js,
}

/// The files of a `lang` project named `name`: (path inside the project, contents).
fn files(lang: Lang, name: &str) -> Vec<(&'static str, String)> {
    let fill = |text: &str| {
        text.replace("{{name}}", name)
            .replace("{{crate}}", &name.replace('-', "_"))
    };
    let mut files = vec![
        ("wit/policy.wit", WIT.to_string()),
        ("cases.json", fill(include_str!("scaffold/cases.json.tmpl"))),
    ];
    match lang {
        Lang::Rust => files.extend([
            (
                "Cargo.toml",
                fill(include_str!("scaffold/rust/Cargo.toml.tmpl")),
            ),
            (
                "src/lib.rs",
                fill(include_str!("scaffold/rust/lib.rs.tmpl")),
            ),
            (
                "README.md",
                fill(include_str!("scaffold/rust/README.md.tmpl")),
            ),
        ]),
        Lang::Python => files.extend([
            ("app.py", fill(include_str!("scaffold/python/app.py.tmpl"))),
            (
                "build.sh",
                fill(include_str!("scaffold/python/build.sh.tmpl")),
            ),
            (
                "requirements.txt",
                fill(include_str!("scaffold/python/requirements.txt.tmpl")),
            ),
            (
                "README.md",
                fill(include_str!("scaffold/python/README.md.tmpl")),
            ),
        ]),
        Lang::Js => files.extend([
            (
                "policy.js",
                fill(include_str!("scaffold/js/policy.js.tmpl")),
            ),
            (
                "package.json",
                fill(include_str!("scaffold/js/package.json.tmpl")),
            ),
            (
                "README.md",
                fill(include_str!("scaffold/js/README.md.tmpl")),
            ),
        ]),
    }
    files
}

/// Writes a new project for policy `name` into `dir` (which must not exist, or be
/// empty). Returns the files written.
pub fn create(dir: &Path, name: &str, lang: Lang) -> Result<Vec<PathBuf>, String> {
    let valid = name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !valid {
        return Err(format!(
            "`{name}` is not a policy name: lower-case letters, digits and `-`, starting \
             with a letter"
        ));
    }
    if dir.exists()
        && std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .next()
            .is_some()
    {
        return Err(format!(
            "{} exists and is not empty; nothing written",
            dir.display()
        ));
    }
    let mut written = Vec::new();
    for (path, text) in files(lang, name) {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        #[cfg(unix)]
        if path.extension().is_some_and(|e| e == "sh") {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scaffold_is_written_whole_once_and_names_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("my-policy");
        let files = create(&project, "my-policy", Lang::Rust).unwrap();
        assert_eq!(files.len(), 5);
        let py = create(&dir.path().join("py"), "py", Lang::Python).unwrap();
        assert!(py.iter().any(|f| f.ends_with("build.sh")));
        let cargo = std::fs::read_to_string(project.join("Cargo.toml")).unwrap();
        assert!(cargo.contains("name = \"my-policy\""), "{cargo}");
        let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
        assert!(readme.contains("release/my_policy.wasm"), "{readme}");
        assert!(!readme.contains("{{"), "{readme}");
        assert_eq!(
            std::fs::read_to_string(project.join("wit/policy.wit")).unwrap(),
            WIT
        );
        let again = create(&project, "my-policy", Lang::Rust).unwrap_err();
        assert!(again.contains("not empty"), "{again}");
        for bad in ["My", "1x", "a b", "a/b", ""] {
            assert!(
                create(&dir.path().join("x"), bad, Lang::Rust).is_err(),
                "{bad}"
            );
        }
    }
}
