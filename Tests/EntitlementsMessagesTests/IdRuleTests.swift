import EntitlementsMessages
import Testing

@Suite("IdRule: 1 to 256 bytes of UTF-8 in NFC")
struct IdRuleTests {
    static let notNFC = "must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"

    @Test("ASCII and composed text are ids", arguments: [
        "user-1", "Zo\u{EB}", "Am\u{E9}lie", "\u{6771}\u{4EAC}", "\u{3A9}", "\u{1EAD}", "\u{1F600}", String(repeating: "x", count: 256),
        String(repeating: "\u{E9}", count: 128),  // 256 bytes
    ])
    func accepted(id: String) {
        #expect(IdRule.problem(id) == nil)
        #expect(IdRule.isNFC(id))
    }

    @Test("decomposed, singleton and reordered forms are refused, though Swift's == calls them equal to an id", arguments: [
        ("Zoe\u{308}", "Zo\u{EB}"),  // e + combining diaeresis
        ("Ame\u{301}lie", "Am\u{E9}lie"),  // e + combining acute
        ("\u{2126}", "\u{3A9}"),  // OHM SIGN, whose NFC is GREEK CAPITAL LETTER OMEGA
        ("a\u{302}\u{323}", "\u{1EAD}"),  // marks out of canonical order
    ])
    func refused(id: String, composed: String) {
        #expect(id == composed && !id.utf8.elementsEqual(composed.utf8))
        #expect(IdRule.problem(id) == Self.notNFC)
        #expect(!IdRule.isNFC(id))
    }

    @Test("length is counted in bytes")
    func length() {
        #expect(IdRule.problem("") == "must not be empty")
        #expect(IdRule.problem(String(repeating: "x", count: 257)) == "must be at most 256 bytes, got 257")
        #expect(IdRule.problem(String(repeating: "\u{E9}", count: 129)) == "must be at most 256 bytes, got 258")
    }
}
