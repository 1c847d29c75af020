from services.admission.service import main

if __name__ == "__main__":
    main()
