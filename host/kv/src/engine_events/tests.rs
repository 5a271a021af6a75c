use super::*;

fn stored<'a>(hashes: &'a [u64], parent: Option<u64>, tokens: &'a [u32]) -> EventOut<'a> {
    EventOut::Stored(StoredOut {
        hashes,
        parent,
        token_ids: tokens,
        block_size: 2,
        ..Default::default()
    })
}

#[test]
fn every_shape_decodes_to_the_same_events() {
    let tokens = [1, 2, 3, 4];
    let big = u64::MAX - 5; // past i64::MAX: SGLang sends it negative
    let (stored_hashes, removed) = ([big, 7], [big]);
    let events = [
        stored(&stored_hashes, Some(3), &tokens),
        EventOut::Removed(&removed),
        EventOut::Cleared,
        EventOut::Other("SomethingNew"),
    ];
    for shape in [Shape::VllmMap, Shape::VllmArray, Shape::Sglang] {
        let batch = decode_batch(&encode_batch(shape, 12.5, 1, &events)).unwrap();
        assert_eq!(batch.ts, 12.5, "{shape:?}");
        assert_eq!(batch.rank, Some(1), "{shape:?}");
        assert_eq!(
            batch.events,
            vec![
                EngineEvent::Stored(StoredBlocks {
                    hashes: vec![big, 7],
                    parent: Some(3),
                    token_ids: tokens.to_vec(),
                    block_size: 2,
                    medium: Medium::Gpu,
                    extra: vec![],
                    group: 0,
                }),
                EngineEvent::Removed {
                    hashes: vec![big],
                    medium: Medium::Gpu,
                    group: 0,
                },
                EngineEvent::Cleared,
                EngineEvent::Unknown("SomethingNew".into()),
            ],
            "{shape:?}"
        );
    }
}

type Field<'a> = (&'a str, &'a dyn Fn(&mut Vec<u8>));

/// Writes a map with the given (key, value-writer) pairs.
fn map(w: &mut Vec<u8>, fields: &[Field<'_>]) {
    rmp::encode::write_map_len(w, fields.len() as u32).unwrap();
    for (k, f) in fields {
        rmp::encode::write_str(w, k).unwrap();
        f(w);
    }
}

#[test]
fn missing_optional_fields_unknown_fields_and_byte_hashes_are_accepted() {
    use rmp::encode as e;
    let mut w = Vec::new();
    let event = |w: &mut Vec<u8>| {
        map(
            w,
            &[
                ("type", &|w| {
                    e::write_str(w, "BlockStored").map(drop).unwrap()
                }),
                ("block_hashes", &|w| {
                    e::write_array_len(w, 1).unwrap();
                    e::write_bin(w, &[9u8; 32]).unwrap();
                }),
                ("token_ids", &|w| {
                    e::write_array_len(w, 2).unwrap();
                    e::write_uint(w, 5).unwrap();
                    e::write_uint(w, 6).unwrap();
                }),
                ("block_size", &|w| e::write_uint(w, 2).map(drop).unwrap()),
                ("kv_cache_spec_kind", &|w| {
                    e::write_str(w, "full").map(drop).unwrap()
                }),
                ("group_idx", &|w| e::write_uint(w, 1).map(drop).unwrap()),
            ],
        )
    };
    map(
        &mut w,
        &[
            ("ts", &|w| e::write_f64(w, 1.0).unwrap()),
            ("events", &|w| {
                e::write_array_len(w, 1).unwrap();
                event(w);
            }),
        ],
    );
    let batch = decode_batch(&w).unwrap();
    assert_eq!(batch.rank, None);
    let EngineEvent::Stored(s) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    assert_eq!(s.hashes, vec![xxhash_rust::xxh3::xxh3_64(&[9u8; 32])]);
    assert_eq!(
        (s.parent, s.medium.clone(), s.group),
        (None, Medium::Gpu, 1)
    );
}

#[test]
fn token_ids_are_read_in_every_integer_encoding() {
    let batch = |write_tokens: &dyn Fn(&mut Vec<u8>)| {
        let mut w = Vec::new();
        rmp::encode::write_array_len(&mut w, 2).unwrap();
        rmp::encode::write_f64(&mut w, 0.0).unwrap();
        rmp::encode::write_array_len(&mut w, 1).unwrap();
        rmp::encode::write_array_len(&mut w, 5).unwrap();
        rmp::encode::write_str(&mut w, "BlockStored").unwrap();
        rmp::encode::write_array_len(&mut w, 1).unwrap();
        rmp::encode::write_uint(&mut w, 9).unwrap();
        rmp::encode::write_nil(&mut w).unwrap();
        write_tokens(&mut w);
        rmp::encode::write_uint(&mut w, 5).unwrap();
        decode_batch(&w)
    };
    let ok = batch(&|w| {
        rmp::encode::write_array_len(w, 5).unwrap();
        rmp::encode::write_pfix(w, 5).unwrap();
        rmp::encode::write_u8(w, 200).unwrap();
        rmp::encode::write_u16(w, 60_000).unwrap();
        rmp::encode::write_i32(w, 7).unwrap();
        rmp::encode::write_u64(w, 4_000_000_000).unwrap();
    })
    .unwrap();
    let EngineEvent::Stored(s) = &ok.events[0] else {
        panic!("{ok:?}")
    };
    assert_eq!(s.token_ids, vec![5, 200, 60_000, 7, 4_000_000_000]);
    for bad_token in [
        &(|w: &mut Vec<u8>| rmp::encode::write_i8(w, -1).map(|_| ()).unwrap())
            as &dyn Fn(&mut Vec<u8>),
        &|w| rmp::encode::write_u64(w, 1 << 33).unwrap(),
        &|w| rmp::encode::write_f64(w, 1.0).unwrap(),
    ] {
        let err = batch(&|w| {
            rmp::encode::write_array_len(w, 5).unwrap();
            for _ in 0..4 {
                rmp::encode::write_pfix(w, 1).unwrap();
            }
            bad_token(w);
        })
        .unwrap_err();
        assert!(err.to_string().contains("token ID"), "{err}");
    }
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for payload in [
        &b""[..],
        b"\xc1",
        b"\x93\x01",
        b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x01",
    ] {
        assert!(decode_batch(payload).is_err(), "{payload:?}");
    }
    // A BlockStored without tokens.
    let mut w = Vec::new();
    rmp::encode::write_array_len(&mut w, 2).unwrap();
    rmp::encode::write_f64(&mut w, 0.0).unwrap();
    rmp::encode::write_array_len(&mut w, 1).unwrap();
    rmp::encode::write_array_len(&mut w, 2).unwrap();
    rmp::encode::write_str(&mut w, "BlockStored").unwrap();
    rmp::encode::write_array_len(&mut w, 0).unwrap();
    assert!(decode_batch(&w).is_err());
    // Every truncation of a valid batch, and an array claiming 4G elements.
    let tokens: Vec<u32> = (0..32).map(|t| t * 70_000).collect();
    let valid = encode_batch(
        Shape::VllmMap,
        1.0,
        0,
        &[EventOut::Stored(StoredOut {
            hashes: &[u64::MAX, 7],
            token_ids: &tokens,
            block_size: 16,
            lora_name: Some("a"),
            cache_salt: Some("s"),
            ..Default::default()
        })],
    );
    assert!(decode_batch(&valid).is_ok());
    for cut in 0..valid.len() {
        assert!(decode_batch(&valid[..cut]).is_err(), "cut at {cut}");
    }
    assert!(decode_batch(b"\xdd\xff\xff\xff\xff\x01").is_err());
}

#[test]
fn lora_and_salt_give_extra_hashes_a_router_can_reproduce() {
    let tokens = [1, 2, 3, 4];
    let ev = EventOut::Stored(StoredOut {
        hashes: &[1, 2],
        parent: None,
        token_ids: &tokens,
        block_size: 2,
        lora_name: Some("adapter-a"),
        cache_salt: Some("tenant-1"),
        ..Default::default()
    });
    let batch = decode_batch(&encode_batch(Shape::VllmMap, 0.0, 0, &[ev])).unwrap();
    let EngineEvent::Stored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(
        s.extra,
        vec![
            extra_hash(&[ExtraKey::Str("adapter-a"), ExtraKey::Str("tenant-1")]),
            extra_hash(&[ExtraKey::Str("adapter-a")]),
        ]
    );
    // Positional events without extra_keys: the adapter name alone, on every block.
    let ev = EventOut::Stored(StoredOut {
        hashes: &[1, 2],
        token_ids: &tokens,
        block_size: 2,
        lora_name: Some("adapter-a"),
        ..Default::default()
    });
    let mut bytes = encode_batch(Shape::VllmArray, 0.0, 0, &[ev]);
    let batch = decode_batch(&bytes).unwrap();
    let EngineEvent::Stored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(s.extra, vec![extra_hash(&[ExtraKey::Str("adapter-a")]); 2]);
    bytes.clear();
    assert_eq!(extra_hash(&[]), 0);
}

#[test]
fn other_media_are_kept_apart() {
    let tokens = [1, 2];
    let ev = EventOut::Stored(StoredOut {
        hashes: &[1],
        token_ids: &tokens,
        block_size: 2,
        medium: Some("CPU"),
        ..Default::default()
    });
    let batch = decode_batch(&encode_batch(Shape::VllmMap, 0.0, 0, &[ev])).unwrap();
    let EngineEvent::Stored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(s.medium, Medium::Other("CPU".into()));
}
