import Testing

@testable import EntitlementsIngestion

@Suite("prices in millionths of an ISO 4217 currency, whatever unit the store used")
struct StorePriceTests {
    @Test("Stripe's smallest units: two decimals by default, zero-decimal and three-decimal currencies, overflow refused")
    func stripeUnits() {
        #expect(StorePrice.micros(smallestUnits: 999, currency: "USD") == 9_990_000)
        #expect(StorePrice.micros(smallestUnits: 500, currency: "JPY") == 500_000_000)
        #expect(StorePrice.micros(smallestUnits: 5120, currency: "KWD") == 5_120_000)
        #expect(StorePrice.micros(smallestUnits: .max / 100, currency: "USD") == nil)
        #expect(StorePrice.micros(smallestUnits: -1, currency: "USD") == nil)
    }

    @Test("a currency is three upper-case letters")
    func currencies() {
        #expect(StorePrice.currency("EUR") == "EUR")
        #expect(StorePrice.currency("eur") == nil)
        #expect(StorePrice.currency("EURO") == nil)
        #expect(StorePrice.currency(nil) == nil)
    }
}
