//! Files the operator names (flags and the config file), read with a size bound: a path
//! that names `/dev/zero` or a multi-gigabyte file by mistake is refused at start with a
//! clear error, instead of exhausting the process.

use std::io::Read;
use std::path::Path;

/// The bytes of `path`, at most `limit` of them; a longer file is an error saying so.
pub fn read(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(format!("it is larger than {limit} bytes"));
    }
    Ok(bytes)
}

/// [`read`], as UTF-8 text.
pub fn read_to_string(path: &Path, limit: u64) -> Result<String, String> {
    String::from_utf8(read(path, limit)?).map_err(|_| "it is not UTF-8 text".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_past_its_bound_is_refused_and_one_within_it_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "0123456789").unwrap();
        assert_eq!(read_to_string(&path, 10).unwrap(), "0123456789");
        assert!(read(&path, 9).unwrap_err().contains("larger than 9 bytes"));
        // An endless source stops at the bound.
        let zero = read(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(zero.contains("larger than"), "{zero}");
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(read_to_string(&path, 10).unwrap_err().contains("UTF-8"));
        assert!(read(&dir.path().join("missing"), 10).is_err());
    }
}
