from services.substrate.service import main

if __name__ == "__main__":
    main()
