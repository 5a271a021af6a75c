use super::*;

#[test]
fn the_byte_table_is_gpt2s() {
    let t = byte_chars();
    assert_eq!(t[usize::from(b'a')], 'a');
    assert_eq!(t[usize::from(b' ')], 'Ġ');
    assert_eq!(t[usize::from(b'\n')], 'Ċ');
    let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
    assert_eq!(distinct.len(), 256);
}

#[test]
fn the_word_cache_holds_at_most_two_generations_and_keeps_pieces_in_use() {
    let mut w = Words::default();
    let hasher = foldhash::fast::RandomState::default();
    let get = |w: &mut Words, piece: &str| {
        let mut out = Vec::new();
        w.get(hasher.hash_one(piece), piece, &mut out)
            .then_some(out)
    };
    w.insert(hasher.hash_one("hot"), "hot", &[7, 8]);
    // A stream of distinct pieces, five generations' worth, the hot one read all along.
    let mut text_capacity = 0;
    for i in 0..5 * WORDS as u32 {
        let piece = i.to_string();
        w.insert(hasher.hash_one(&piece), &piece, &[i]);
        if i % 1000 == 0 {
            assert_eq!(get(&mut w, "hot"), Some(vec![7, 8]), "a piece in use stays");
        }
        assert!(w.new.table.len() + w.old.table.len() <= 2 * WORDS);
        if i == 2 * WORDS as u32 {
            text_capacity = w.new.text.capacity() + w.old.text.capacity();
        }
    }
    assert_eq!(get(&mut w, "0"), None, "an old piece nobody read is gone");
    assert_eq!(
        get(&mut w, &(5 * WORDS - 1).to_string()),
        Some(vec![5 * WORDS as u32 - 1])
    );
    // Once grown, the buffers are reused: later generations (longer numbers) added
    // at most one byte per piece.
    let now = w.new.text.capacity() + w.old.text.capacity();
    assert!(
        now <= text_capacity + 2 * WORDS,
        "{now} against {text_capacity}"
    );
}

#[test]
fn shapes_it_cannot_run_say_why() {
    let vocab = serde_json::to_string(
        &byte_chars()
            .iter()
            .enumerate()
            .map(|(id, c)| (c.to_string(), id))
            .collect::<std::collections::HashMap<_, _>>(),
    )
    .unwrap();
    let base = |pre: &str, extra: &str| {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{extra}],
            "normalizer":null,"pre_tokenizer":{pre},"post_processor":null,"decoder":null,
            "model":{{"type":"BPE","dropout":null,"vocab":{vocab},"merges":[]}}}}"#
        )
    };
    let bl = r#"{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}"#;
    assert!(ByteLevelBpe::new(&base(bl, "")).is_ok());
    let prefix = r#"{"type":"ByteLevel","add_prefix_space":true,"use_regex":true}"#;
    let e = ByteLevelBpe::new(&base(prefix, "")).err().unwrap();
    assert!(e.contains("add_prefix_space"), "{e}");
    let meta = r#"{"type":"Metaspace","replacement":"▁"}"#;
    assert!(ByteLevelBpe::new(&base(meta, "")).is_err());
    let lstrip = r#"{"id":5,"content":"<mask>","lstrip":true,"rstrip":false,"single_word":false,"normalized":false,"special":true}"#;
    let e = ByteLevelBpe::new(&base(bl, lstrip)).err().unwrap();
    assert!(e.contains("strip"), "{e}");
    // A model whose vocabulary is a list (Unigram's) is refused by its type.
    let unigram = r#"{"truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
        "pre_tokenizer":null,"model":{"type":"Unigram","unk_id":0,"vocab":[["a",-1.0]]}}"#;
    let e = ByteLevelBpe::new(unigram).err().unwrap();
    assert!(e.contains("Unigram"), "{e}");
}
