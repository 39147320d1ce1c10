/// Prices as the answer carries them: millionths of an ISO 4217 currency
/// (docs/ingestion.md, "Prices").
enum StorePrice {
    /// `code` when it is an ISO 4217 code in upper case; nil otherwise.
    static func currency(_ code: String?) -> String? {
        guard let code, code.utf8.count == 3, code.utf8.allSatisfy({ (0x41...0x5A).contains($0) }) else {
            return nil
        }
        return code
    }

    /// Stripe's zero-decimal currencies (an amount of 500 JPY is 500, not 5.00).
    static let zeroDecimal: Set<String> = [
        "BIF", "CLP", "DJF", "GNF", "JPY", "KMF", "KRW", "MGA", "PYG", "RWF", "UGX", "VND", "VUV", "XAF", "XOF", "XPF",
    ]
    /// Stripe's three-decimal currencies.
    static let threeDecimal: Set<String> = ["BHD", "JOD", "KWD", "OMR", "TND"]

    /// An amount in the currency's smallest unit (Stripe's `amount` fields) in millionths;
    /// nil when negative or too large.
    static func micros(smallestUnits amount: Int64, currency: String) -> Int64? {
        let factor: Int64 = zeroDecimal.contains(currency) ? 1_000_000 : threeDecimal.contains(currency) ? 1_000 : 10_000
        guard amount >= 0, amount <= Int64.max / factor else {
            return nil
        }
        return amount * factor
    }
}
